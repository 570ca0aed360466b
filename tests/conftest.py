import functools
import os
import resource

import pytest
import torch
from hypothesis import settings
from transformers import AutoModelForCausalLM, AutoTokenizer

from shuttle.common.config import LOG_LEVEL_ENV
from tests.hf_cache import REPO_ID, cache_with
from tests.server import MODEL_DIR, ShuttleServer

pytest_plugins = ["tests.loop_guard", "pytester"]


# Property tests draw the same examples on every run, so a run's result is a function of the code (a random draw once
# failed a run on a latent bug that no change had touched); SHUTTLE_HYPOTHESIS=explore draws new ones, to look for more.
settings.register_profile("fixed", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("SHUTTLE_HYPOTHESIS", "fixed"))

SHARED_SERVERS = {"server", "chunked_server", "keyed_server", "slow_server"}


def pytest_itemcollected(item):
    """Every test that starts real shuttle processes is `slow` (`pytest -m "not slow"` runs the lower rungs only):
    those using a shared server fixture or living in a module that starts its own ShuttleServer.

    For pytest-xdist's `--dist loadgroup` (`pytest -n 2`), every test that uses a shared server is in one group and
    every other test in its module's, so that each session- or module-scoped server starts once, on one worker.
    (Marked as each item is collected: xdist reads the groups in its own collection_modifyitems.)"""
    module = getattr(item, "module", None)
    fixtures = set(getattr(item, "fixturenames", ()))
    if SHARED_SERVERS & fixtures or (module is not None and "ShuttleServer" in vars(module)):
        item.add_marker(pytest.mark.slow)
    group = "shared-servers" if SHARED_SERVERS & fixtures else item.nodeid.split("::")[0]
    item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Run order for `-n 2 --dist loadgroup` (with pyproject's `--no-loadscope-reorder`, which keeps this order):
    the shared-server group, then every other group that starts processes, then the in-process tests. xdist hands a
    worker its next group as it runs dry, so the long groups start first and the many short ones fill in at the end;
    its default order (most tests first) left one-test groups like the GPU check's dry run for last, on one worker."""
    def group(item):
        mark = item.get_closest_marker("xdist_group")
        return mark.args[0] if mark else item.nodeid.split("::")[0]
    slow_groups = {group(item) for item in items if item.get_closest_marker("slow")}
    rank = {name: (0 if name == "shared-servers" else 1 if name in slow_groups else 2) for name in map(group, items)}
    items.sort(key=lambda item: rank[group(item)])  # stable: collection order within a rank


@pytest.fixture
def no_launch(monkeypatch):
    """serve() and engine() in process, failing the test if they get as far as starting the processes (so that a
    refusal can be tested without a new interpreter, whose imports alone take seconds)."""
    from shuttle.launcher import commands

    def refuse(*args, **kwargs):
        raise AssertionError("the launcher started processes")
    monkeypatch.setattr(commands, "Launcher", refuse)
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)  # launcher.cli.main sets it for its children; restored after


_worker_launches: list[int] = []


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its count goes back to the controller
        session.config.workeroutput["shuttle_launches"] = ShuttleServer.launches


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _worker_launches.append(getattr(node, "workeroutput", {}).get("shuttle_launches", 0))


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"shuttle servers launched: {ShuttleServer.launches + sum(_worker_launches)}")


torch.set_num_threads(1)  # the transformers reference: see tests/server.py on OpenMP threads on a shared machine


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Every test starts at one torch thread: numba's first parallel launch (the CPU decode kernel) raises the
    process's OpenMP threads, and a test that ran after it at two threads saw other roundings."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@functools.cache
def hf_model():
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()


@functools.cache
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def hf_greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate on the same model directory: the reference for exactness."""
    return list(_hf_greedy(tuple(prompt_ids), max_new_tokens))


@functools.cache
def _hf_greedy(prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    with torch.inference_mode():
        out = hf_model().generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return tuple(out[0, len(prompt_ids):].tolist())


# The suite's shared servers, each started on first use and stopped at the end of the run. Tests on them must not
# depend on what other modules left behind (prefix cache contents, counters): they take deltas or wait for idle.
CHAT_TEMPLATE = "tests/data/stories_chat.jinja"
API_KEY = "sk-secret-from-file"
SLOW_STEP_DELAY = 0.4  # seconds per step on `slow_server`: long enough that requests are surely in flight


@pytest.fixture(scope="session")
def server():
    """stories260K with default engine flags, a chat template, auto tool choice with the hermes parser (the template
    ignores tools: stories260K's 512-token context has no room for them) and a waiting queue no test fills."""
    srv = ShuttleServer("--chat-template", CHAT_TEMPLATE, "--max-waiting-requests", "100000",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def chunked_server(tmp_path_factory):
    """Chunked prefill at 16 tokens a step, at most 3 running sequences, no prefix caching; MODEL is the Hugging Face
    id `hf_cache.REPO_ID`, resolved offline from a cache laid out in a temporary HF_HOME (`srv.hf_home`)."""
    hf_home = tmp_path_factory.mktemp("hf")
    (hf_home / "hub").mkdir()
    cache_with(hf_home / "hub")
    srv = ShuttleServer("--max-num-batched-tokens", "16", "--max-num-seqs", "3", "--no-enable-prefix-caching",
                        model_dir=REPO_ID, env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    srv.hf_home = hf_home
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory):
    """tcp transport between the processes, API_KEY from a file, the served model name "stories", a chat template,
    and an open-file soft limit of 1024 set before exec."""
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(API_KEY + "\n")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    srv = ShuttleServer("--zmq-transport", "tcp", "--api-key-file", str(key_file), "--served-model-name", "stories",
                        "--chat-template", CHAT_TEMPLATE,
                        preexec=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def slow_server(tmp_path_factory):
    """Every step takes at least SLOW_STEP_DELAY s (the worker's test hook), and each is written to
    `srv.step_log_path` (--step-log)."""
    path = tmp_path_factory.mktemp("steps") / "steps.jsonl"
    srv = ShuttleServer("--step-log", str(path), step_delay=SLOW_STEP_DELAY)
    srv.step_log_path = path
    yield srv
    srv.stop()
