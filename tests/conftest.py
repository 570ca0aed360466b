import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.server import MODEL_DIR, ShuttleServer


def pytest_collection_modifyitems(items):
    """Every test that starts real shuttle processes is `slow` (`pytest -m "not slow"` runs the lower rungs only):
    those using the `server` fixture or living in a module that starts its own ShuttleServer."""
    for item in items:
        module = getattr(item, "module", None)
        if "server" in getattr(item, "fixturenames", ()) or (module is not None and "ShuttleServer" in vars(module)):
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"shuttle servers launched: {ShuttleServer.launches}")


torch.set_num_threads(1)  # the transformers reference: see tests/server.py on OpenMP threads on a shared machine


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


@pytest.fixture(scope="module")
def server():
    """A default stories260K server shared by a test module."""
    srv = ShuttleServer()
    yield srv
    srv.stop()
