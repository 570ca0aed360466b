"""Issue 43, acceptance 2: the production `vllm serve` command line of docs/vllm-flags.md starts shuttle, unchanged but
for the model path, and serves a chat request through the official `openai` client with its API key and served name.

The line is tests/unit/test_vllm_flags.py's PRODUCTION_LINE (which also checks the config it parses into); the test
harness adds only what every test server gets: --port 0 for P, one worker thread, and a small KV cache (the line's
--gpu-memory-utilization sizes nothing on a CPU)."""

from __future__ import annotations

import openai
import pytest

from tests.server import TEST_KV_CACHE_MEMORY, ShuttleServer
from tests.unit.test_vllm_flags import CHAT_TEMPLATE, production_argv


@pytest.fixture(scope="module")
def production_server(tmp_path_factory):
    srv = ShuttleServer(*production_argv("0", CHAT_TEMPLATE, str(tmp_path_factory.mktemp("download-dir"))),
                        "--kv-cache-memory", TEST_KV_CACHE_MEMORY)
    yield srv
    srv.stop()


def test_the_production_command_line_serves_a_chat_request(production_server):
    client = openai.OpenAI(base_url=f"{production_server.url}/v1", api_key="secret", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="my-model", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True})
    response = raw.parse()
    assert raw.status_code == 200 and response.model == "my-model"
    assert (response.usage.completion_tokens, response.choices[0].finish_reason) == (12, "length")
    assert response.choices[0].message.role == "assistant"
    with pytest.raises(openai.AuthenticationError):  # --api-key secret is enforced
        openai.OpenAI(base_url=f"{production_server.url}/v1", api_key="wrong", max_retries=0).models.list()
