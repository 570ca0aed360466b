"""The frontend's side of SLO admission, in process with a fake engine: the request's `ttft_slo_ms` reaches the
scheduler, a refusal is HTTP 503 with the scheduler's Retry-After, and /metrics counts it as reason "slo"."""

from aiohttp.test_utils import TestClient, TestServer

from shuttle.common.config import IpcConfig, SchedulerConfig, ShuttleConfig
from shuttle.common.model_config import ModelConfig
from shuttle.frontend.app import build_app
from shuttle.frontend.observability.metrics import Metrics
from shuttle.frontend.request.chat_template import ChatTemplate
from shuttle.frontend.state import FrontendState
from shuttle.frontend.tokenizer import TextTokenizer
from tests.fake_engine import FakeEngine
from tests.server import MODEL_DIR


async def test_refusal_is_503_with_retry_after_and_counted_as_slo():
    model = ModelConfig.from_dir(MODEL_DIR)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                           scheduler=SchedulerConfig(ttft_slo_ms=100.0))
    # refuses every request as the scheduler's SLO admission does
    engine = FakeEngine(error=(503, "the server cannot meet the TTFT objective now"), retry_after_s=7.0,
                        rejection="slo")
    state = FrontendState(config, engine, TextTokenizer(model.model_dir), ChatTemplate(model.model_dir),
                          Metrics(lambda: engine.stats))
    async with TestClient(TestServer(build_app(state))) as client:
        response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ttft_slo_ms": 250})
        assert response.status == 503 and response.headers["Retry-After"] == "7"
        body = await response.json()
        assert body["error"]["code"] == 503 and "TTFT objective" in body["error"]["message"]
        response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
        assert response.status == 503
        response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ttft_slo_ms": -1})
        assert response.status == 400 and (await response.json())["error"]["param"] == "ttft_slo_ms"
        metrics = await (await client.get("/metrics")).text()
    # the request's own objective, else the scheduler applies the server's
    assert [request.ttft_slo_ms for request in engine.submitted] == [250.0, 0.0]
    assert 'shuttle:request_rejected_total{reason="slo"} 2.0' in metrics
