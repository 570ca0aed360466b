"""Start-up shared by the child processes (common/process.py), without processes: report_ready tells the launcher
who is up, and freezes the start-up heap first."""

import gc
import os

import msgspec
import zmq

from shuttle.common.config import IpcConfig, ShuttleConfig
from shuttle.common.messages import ProcessReady
from shuttle.common.model_config import ModelConfig
from shuttle.common.process import report_ready
from tests.server import MODEL_DIR


def test_report_ready_freezes_the_startup_heap_then_tells_the_launcher(tmp_path):
    """What is alive when start-up ends is out of every generation the collector walks while serving (gc.freeze);
    then one ProcessReady with this pid and the process's figures reaches the launcher's control socket."""
    config = ShuttleConfig(ModelConfig.from_dir(MODEL_DIR), IpcConfig.in_directory(str(tmp_path)))
    ctx = zmq.Context.instance()
    launcher = ctx.socket(zmq.PULL)
    launcher.bind(config.ipc.control)
    gc.unfreeze()
    built_at_startup = [object()]
    try:
        report_ready(config, "worker", num_kv_blocks=64)
        assert not any(o is built_at_startup for o in gc.get_objects())
        assert launcher.poll(5000)
        message = msgspec.msgpack.decode(launcher.recv(), type=ProcessReady)
        assert (message.name, message.pid, message.info) == ("worker", os.getpid(), {"num_kv_blocks": 64})
    finally:
        gc.unfreeze()
        launcher.close(linger=0)
