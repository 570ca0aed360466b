"""A slow start of one unit (under Ray, a placement group can take up to a minute) must not make the launcher judge
the other units silent: the heartbeats they sent meanwhile are read before their next check."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import msgspec
import zmq

from shuttle.common.config import IpcConfig, OpsConfig, ShuttleConfig
from shuttle.common.messages import Heartbeat
from shuttle.common.model_config import ModelConfig
from shuttle.launcher.launcher import Launcher
from shuttle.launcher.supervised_unit import Unit
from tests.server import MODEL_DIR

HEARTBEAT_TIMEOUT_S = 0.4
START_S = 1.0  # the slow start: longer than the heartbeat timeout


def test_heartbeats_sent_during_a_slow_restart_are_read_before_the_others_are_judged(tmp_path):
    ipc = IpcConfig.in_directory(str(tmp_path))
    config = ShuttleConfig(ModelConfig.from_dir(MODEL_DIR), ipc, ops=OpsConfig(heartbeat_timeout=HEARTBEAT_TIMEOUT_S))
    launcher = Launcher(config, None, with_frontend=False)
    serving = Unit("engine of group 1", ("worker",), group=1)  # ready, beating every 0.1 s
    serving.procs = {"worker": SimpleNamespace(pid=4242, poll=lambda: None, returncode=None)}  # type: ignore[dict-item]
    serving.ready, serving.heartbeats = {"worker": {}}, {"worker": time.monotonic()}
    killed = []
    serving.kill = lambda *args: killed.append("engine of group 1")  # type: ignore[method-assign]
    child = zmq.Context.instance().socket(zmq.PUSH)
    child.connect(ipc.control)
    beating = threading.Event()

    def beat() -> None:
        while not beating.is_set():
            child.send(msgspec.msgpack.encode(Heartbeat(name="worker", pid=4242)))
            time.sleep(0.1)

    def slow_start(config, env) -> None:
        time.sleep(START_S)  # the loop is held here, while the other unit keeps beating
        restarting.restart_at = None
        launcher.signals = 1  # then stop: the loop's next turn drains and returns

    restarting = SimpleNamespace(name="engine of group 0", restart_at=0.0, engine_group=0, start=slow_start,
                                 on_control=lambda msg: None)
    launcher.units = [restarting, serving]
    launcher.engines = []
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        assert launcher._supervise() == 0
    finally:
        beating.set()
        thread.join()
        child.close()
        launcher.control.close()
    assert killed == []  # without the read after the start: "sent no heartbeat for 1 s", and a needless restart
