"""Issue 43, acceptance 2: the production `vllm serve` command line of docs/vllm-flags.md starts shuttle, unchanged but
for the model path, and serves a chat request through the official `openai` client with its API key and served name.

The line is tests/unit/test_vllm_flags.py's PRODUCTION_LINE (which also checks the config it parses into); the test
harness adds only what every test server gets: --port 0 for P, one worker thread, and a small KV cache (the line's
--gpu-memory-utilization sizes nothing on a CPU)."""

from __future__ import annotations

import json

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


def test_its_reasoning_parser_serves_a_model_without_think_tokens_as_plain_content(production_server):
    # --reasoning-parser deepseek_r1 on stories260K, whose tokenizer has no <think>: the output is content, and a
    # structured output constrains it from the first token (frontend/reasoning/; docs/api.md, reasoning models)
    client = openai.OpenAI(base_url=f"{production_server.url}/v1", api_key="secret", max_retries=0)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    response = client.chat.completions.create(
        model="my-model", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    message = response.choices[0].message
    assert set(json.loads(message.content)) == {"n"} and response.choices[0].finish_reason == "stop"
    assert "reasoning_content" not in (message.model_extra or {})
