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
        async with client.get("/openapi.json") as response:
            schemas = (await response.json())["components"]["schemas"]
        assert {"type": "string"} in schemas["CompletionRequest"]["properties"]["model"]["anyOf"]  # adapters too


async def test_without_enable_lora_an_adapter_name_is_an_unknown_model():
    async with served() as (client, _):
        status, _ = await post(client, "/v1/completions", {"model": "sql", "prompt": PROMPT, "max_tokens": 2})
        assert status == 404


async def test_adapters_load_and_unload_at_run_time_under_vllms_rule(tmp_path, monkeypatch):
    import json

    from safetensors.torch import load_file, save_file

    from tests.engine.test_lora_engine import write_adapter
    from tests.server import MODEL_DIR

    good = write_adapter(tmp_path / "good", MODEL_DIR, {"q_proj", "down_proj"}, rank=4, alpha=8, seed=1)
    wide = write_adapter(tmp_path / "wide", MODEL_DIR, {"q_proj"}, rank=32, alpha=8, seed=2)
    skewed = write_adapter(tmp_path / "skewed", MODEL_DIR, {"v_proj"}, rank=2, alpha=2, seed=3)
    (skewed / "adapter_config.json").write_text(json.dumps({**json.loads((skewed / "adapter_config.json")
                                                                         .read_text()), "r": 4}))
    load = {"lora_name": "live", "lora_path": str(good)}
    enabled = LoRAConfig(enable_lora=True)
    async with served(lora=enabled) as (client, _):  # without VLLM_ALLOW_RUNTIME_LORA_UPDATING: no such route
        async with client.post("/v1/load_lora_adapter", json=load) as response:
            assert response.status == 404
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    async with served(lora=enabled) as (client, engine):
        async with client.post("/v1/load_lora_adapter", json=load) as response:
            assert (response.status, await response.text()) == (200, "Success: LoRA adapter 'live' added successfully.")
        status, body = await post(client, "/v1/load_lora_adapter", load)
        assert (status, body["error"]["message"]) == (400, "The lora adapter 'live' has already been loaded.")
        for name, why in [(SERVED, "is the served model's name"), ("a,b", "without a comma"),
                          ("a\x00b", "printable characters"), ("x" * 257, "at most 256")]:
            status, body = await post(client, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(good)})
            assert status == 400 and why in body["error"]["message"] and body["error"]["param"] == "lora_name", body
        poisoned = write_adapter(tmp_path / "poisoned", MODEL_DIR, {"q_proj"}, rank=4, alpha=8, seed=4)
        cut = write_adapter(tmp_path / "cut", MODEL_DIR, {"q_proj"}, rank=4, alpha=8, seed=5)
        tensors = load_file(str(poisoned / "adapter_model.safetensors"))
        next(iter(tensors.values()))[0, 0] = float("nan")
        save_file(tensors, str(poisoned / "adapter_model.safetensors"))
        weights = cut / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
        unlisted = write_adapter(tmp_path / "unlisted", MODEL_DIR, {"q_proj", "v_proj"}, rank=4, alpha=8, seed=6)
        config = json.loads((unlisted / "adapter_config.json").read_text())
        (unlisted / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj"]}))
        for path, why in [(poisoned, "holds NaN or infinite values"), (cut, "is not a valid safetensors file"),
                          (wide, "rank 32 exceeds --max-lora-rank 16"),
                          (unlisted, "adapts v_proj, which its target_modules (q_proj) does not list"),
                          (skewed, "v_proj has A (2, 64) and B (32, 2), the layer needs A [4, 64] and B [32, 4]"),
                          (tmp_path / "nowhere", "no adapter_config.json")]:
            status, body = await post(client, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(path)})
            assert status == 400 and why in body["error"]["message"], body
        async with client.get("/v1/models") as response:
            assert [m["id"] for m in (await response.json())["data"]] == [SERVED, "live"]
        status, _ = await post(client, "/v1/completions", {"model": "live", "prompt": PROMPT, "max_tokens": 2})
        submitted = engine.submitted[-1]
        assert status == 200 and (submitted.lora_name, submitted.lora_path) == ("live", str(good))
        async with client.post("/v1/unload_lora_adapter", json={"lora_name": "live"}) as response:
            assert response.status == 200
            assert await response.text() == "Success: LoRA adapter 'live' removed successfully."
        status, _ = await post(client, "/v1/completions", {"model": "live", "prompt": PROMPT, "max_tokens": 2})
        assert status == 404
        # loaded again from the same directory (its files may have changed): another load id, so the scheduler's
        # slots and prefix cache take it for other weights
        async with client.post("/v1/load_lora_adapter", json=load) as response:
            assert response.status == 200
        assert (await post(client, "/v1/completions", {"model": "live", "prompt": PROMPT, "max_tokens": 2}))[0] == 200
        again = engine.submitted[-1]
        assert (again.lora_path, again.lora_name) == (submitted.lora_path, "live")
        assert again.lora_load_id and submitted.lora_load_id and again.lora_load_id != submitted.lora_load_id
        async with client.post("/v1/unload_lora_adapter", json={"lora_name": "live"}) as response:
            assert response.status == 200
        status, body = await post(client, "/v1/unload_lora_adapter", {"lora_name": "live"})
        assert (status, body["error"]["message"]) == (404, "The lora adapter 'live' cannot be found.")
