"""tests/loop_guard.py against the mechanism that hung CI: an openai client left open and collected during a later
test takes that test's new listening socket out of the shared event loop's epoll set (the stale selector key for the
reused fd number makes add_reader a no-op), so its request is never answered."""

import os
import shutil
from pathlib import Path

DATA = Path(__file__).parents[1] / "data"
INI = """[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = session
asyncio_default_test_loop_scope = session
"""


def run_leaky_tests(pytester, monkeypatch, *plugins: str):
    pytester.makeini(INI)
    shutil.copy(DATA / "leaky_client_tests.py", pytester.path / "test_leaky.py")
    root = str(Path(__file__).parents[2])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:langsmith_plugin", *plugins)


def test_without_the_guard_the_next_servers_request_hangs(pytester, monkeypatch):
    result = run_leaky_tests(pytester, monkeypatch)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_leaky.py::test_next_server_is_polled - TimeoutError*"])


def test_the_guard_fails_the_test_that_left_the_client_open_and_the_next_one_passes(pytester, monkeypatch):
    result = run_leaky_tests(pytester, monkeypatch, "-p", "tests.loop_guard")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["ERROR test_leaky.py::test_leaves_a_client_open - Failed: 1 async HTTP client*"])
