"""Issue 46: --distributed-executor-backend ray refuses what it cannot do, each in one line with exit status 2, before
anything starts: Ray not installed, `shuttle engine` under it, --engine-endpoint beside it, and Ray's placement flags
without it (nothing is taken and ignored)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.server import MODEL_DIR


def refused(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_without_ray_installed_the_backend_is_one_line(tmp_path):
    (tmp_path / "ray").mkdir()  # a `ray` package that fails to import, as where it is not installed
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    line = refused("serve", str(MODEL_DIR), "--port", "0", "--distributed-executor-backend", "ray",
                   env={"PYTHONPATH": str(tmp_path)})
    assert line == "shuttle: error: --distributed-executor-backend ray needs Ray (pip install 'shuttle[ray]')"


@pytest.mark.parametrize("flags, why", [
    (["--ray-address", "10.0.0.1:6379"], "--ray-address: it places serving groups on Ray, which needs "
                                         "--distributed-executor-backend ray"),
    (["--ray-placement-strategy", "SPREAD"], "--ray-placement-strategy: it places serving groups on Ray"),
])
def test_ray_flags_without_the_ray_backend_are_refused(flags, why):
    assert why in refused("serve", str(MODEL_DIR), "--port", "0", *flags)
    assert why in refused("engine", str(MODEL_DIR), "--listen", "ipc:///tmp/shuttle-engine-test.sock", *flags)


def test_an_address_where_nothing_answers_is_one_line_at_once():
    """ray.init would retry an absent cluster for minutes, deaf to Ctrl-C: the address is asked once first."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: nothing answers there
        line = refused("serve", str(MODEL_DIR), "--port", "0", "--distributed-executor-backend", "ray",
                       "--ray-address", f"127.0.0.1:{port}")
    assert line.startswith(f"shuttle: error: cannot join the Ray cluster at 127.0.0.1:{port}: nothing answers there")


def test_engine_and_remote_groups_do_not_go_with_ray():
    assert "`shuttle engine` runs its serving group on this host" in refused(
        "engine", str(MODEL_DIR), "--listen", "ipc:///tmp/shuttle-engine-test.sock", "--distributed-executor-backend",
        "ray")
    assert "--engine-endpoint and --distributed-executor-backend ray do not go together" in refused(
        "serve", str(MODEL_DIR), "--port", "0", "--distributed-executor-backend", "ray", "--engine-endpoint",
        "ipc:///tmp/shuttle-remote.sock")
