"""LoRA adapters on the HTTP API over the scripted engine: /v1/models lists each adapter with its parent, a request
naming an adapter as its model reaches the engine with that adapter (completions, chat, the Messages API), and an
unknown model is a 404 naming it."""

from shuttle.common.lora import LoRAConfig, LoRAModule
from tests.api.test_api_details import PROMPT, USER, post, served
from tests.fake_engine import SERVED

LORA = LoRAConfig(enable_lora=True, lora_modules=(LoRAModule(name="sql", path="/adapters/sql"),
                                                   LoRAModule(name="fr", path="/adapters/fr", base_model_name="base")))


async def test_models_list_the_adapters_and_requests_reach_the_engine_with_theirs():
    async with served(lora=LORA) as (client, engine):
        async with client.get("/v1/models") as response:
            models = (await response.json())["data"]
        assert [(m["id"], m.get("parent"), m["root"]) for m in models][1:] == [
            ("sql", SERVED, "/adapters/sql"), ("fr", "base", "/adapters/fr")]
        async with client.get("/v1/models/sql") as response:
            assert (await response.json())["parent"] == SERVED
        assert (await post(client, "/v1/completions", {"model": "sql", "prompt": PROMPT, "max_tokens": 2}))[0] == 200
        assert (await post(client, "/v1/chat/completions", {"model": "fr", "messages": USER, "max_tokens": 2}))[0] \
            == 200
        assert (await post(client, "/v1/completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": 2}))[0] \
            == 200
        assert (await post(client, "/v1/messages", {"model": "sql", "messages": USER, "max_tokens": 2}))[0] == 200
        assert [s.lora_name for s in engine.submitted] == ["sql", "fr", "", "sql"]
        status, body = await post(client, "/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2})
        assert status == 404 and body["error"]["message"].startswith("The model `nope` does not exist")
        assert "`sql`" in body["error"]["message"] and "`fr`" in body["error"]["message"]


async def test_without_enable_lora_an_adapter_name_is_an_unknown_model():
    async with served() as (client, _):
        status, _ = await post(client, "/v1/completions", {"model": "sql", "prompt": PROMPT, "max_tokens": 2})
        assert status == 404
