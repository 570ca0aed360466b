"""`shuttle serve` and `shuttle engine` refuse bad start-up input before any process starts: one line on stderr and
exit status 2, for a bad model directory (common/model_dir.py) and for a port the launch would listen on that is
taken, naming the port and the flag that chose it (launcher/ports.py)."""

import shutil
import socket
import subprocess
import sys

import pytest

from shuttle.common.ipc import CURVE_ENV, CurveKeys
from shuttle.launcher import commands
from shuttle.launcher.cli import build_parser
from shuttle.launcher.ports import Listen, PortError, check_ports
from tests.server import MODEL_DIR, REPO


def shuttle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", *args], cwd=REPO, capture_output=True,
                          text=True,
                          timeout=60)


def assert_refused(result: subprocess.CompletedProcess, message: str) -> None:
    """Exit 2 with `message` as the only line: nothing on stdout, so no process was started (each child would log
    its start-up; the worker would load the model first)."""
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr[-2000:]
    assert result.stdout == ""


def test_a_model_directory_without_weights(tmp_path):
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(MODEL_DIR / name, tmp_path / name)
    assert_refused(shuttle("serve", str(tmp_path), "--port", "0"),
                   f"shuttle: error: {tmp_path} has no weights (none of model.safetensors, ")


def test_a_path_to_config_json_names_its_directory():
    assert_refused(shuttle("serve", str(MODEL_DIR / "config.json"), "--port", "0"),
                   f"config.json is a file; pass its directory {MODEL_DIR}")


def listening(port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def a_taken_port_above_a_free_one() -> tuple[socket.socket, int]:
    """(a socket listening on P + 1, P) with P free when this returns."""
    for _ in range(100):
        taken = listening()
        port = taken.getsockname()[1] - 1
        try:
            listening(port).close()
            return taken, port
        except OSError:
            taken.close()
    raise RuntimeError("no free port below a taken one")


def test_the_batch_endpoint_on_port_plus_one_is_named_when_taken():
    """Issue 24: with --port P free and P + 1 taken, the error used to blame P, after the model had loaded."""
    taken, port = a_taken_port_above_a_free_one()
    with taken:
        result = shuttle("serve", str(MODEL_DIR), "--port", str(port))
    assert_refused(result, f"port {port + 1} (the batch endpoint, PORT+1 unless --batch-endpoint says otherwise")
    assert "is in use" in result.stderr


def refusal(capsys, *argv: str) -> str:
    args = build_parser().parse_args(argv)
    status = (commands.serve if args.command == "serve" else commands.engine)(args)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    return err


def test_the_http_port_is_named_when_taken(no_launch, capsys):
    with listening() as taken:
        port = taken.getsockname()[1]
        err = refusal(capsys, "serve", str(MODEL_DIR), "--port", str(port), "--batch-endpoint", "none")
    assert f"port {port} (the HTTP server, --port) is in use" in err


def test_a_batch_endpoint_on_the_http_port_is_a_clash(no_launch, capsys):
    with listening() as free:
        port = free.getsockname()[1]
    err = refusal(capsys, "serve", str(MODEL_DIR), "--port", str(port), "--batch-endpoint", f"tcp://127.0.0.1:{port}")
    assert f"port {port} (the batch endpoint, --batch-endpoint) is in use" in err


def test_no_port_is_left_for_the_batch_endpoint_above_65535(no_launch, capsys):
    err = refusal(capsys, "serve", str(MODEL_DIR), "--port", "65535", "--host", "127.0.0.1")
    assert "port 65536 (the batch endpoint, PORT+1 unless --batch-endpoint" in err and "not a TCP port" in err


def test_a_taken_rendezvous_port_is_named(no_launch, capsys):
    with listening() as taken:
        port = taken.getsockname()[1]
        err = refusal(capsys, "serve", str(MODEL_DIR), "--port", "0", "--tensor-parallel-size", "2",
                      "--master-port", str(port))
    assert f"port {port} (the tensor-parallel rendezvous, --master-port) is in use" in err


def test_a_taken_engine_endpoint_is_named(no_launch, capsys, monkeypatch):
    monkeypatch.setenv(CURVE_ENV, CurveKeys.generate().to_env())
    with listening() as taken:
        port = taken.getsockname()[1]
        err = refusal(capsys, "engine", str(MODEL_DIR), "--listen", f"tcp://127.0.0.1:{port}")
    assert f"port {port} (where frontends reach this engine, --listen) is in use" in err


def test_a_host_that_is_not_this_machines_is_named():
    with pytest.raises(PortError, match=r"port 9 \(x\): 192\.0\.2\.1 is not an address of this host"):
        check_ports([Listen("192.0.2.1", 9, "x")])  # TEST-NET-1: never a local address


def test_a_port_in_time_wait_is_free():
    """Only a listener makes a port taken: a previous server's closed connections in TIME_WAIT do not (shuttle's
    servers, like this check, bind with SO_REUSEADDR)."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
    client.close()
    server.close()
    assert any(line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "06"  # 06: TIME_WAIT
               for line in open("/proc/net/tcp").read().splitlines()[1:])
    check_ports([Listen("127.0.0.1", port, "x")])
