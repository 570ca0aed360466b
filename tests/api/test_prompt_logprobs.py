"""vLLM's prompt_logprobs on /v1/completions and /v1/chat/completions, through the openai client: the real frontend
over stories260K's real scheduler and model runner in this process (ModelEngine), checked against transformers; the
request's checks and the echo's interplay over the FakeEngine."""

from __future__ import annotations

import math
from typing import AsyncIterator

import openai
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from shuttle.common.config import ApiConfig
from shuttle.common.errors import InvalidRequestError
from shuttle.common.messages import RequestOutput, Submit
from shuttle.common.sampling import logprobs_limit
from shuttle.frontend.completions.prompt_logprobs import prompt_logprobs_of
from shuttle.frontend.tokenizer import TextTokenizer
from tests.api.test_api_details import PROMPT, PROMPT_IDS, post, served
from tests.conftest import hf_tokenizer
from tests.engine.test_engine_inprocess import ATOL, make_engine, reference_log_softmax
from tests.fake_engine import SERVED, TOP, FakeEngine, frontend_app, sampled_logprob
from tests.server import MODEL_DIR

TOKENIZER = TextTokenizer(str(MODEL_DIR))
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside"


class ModelEngine(FakeEngine):
    """The FakeEngine's admission, with a real Scheduler and ModelRunner behind it, stepped in the event loop's
    thread (a test's few tiny requests; each generator steps until its own output is there)."""

    def __init__(self, max_num_batched_tokens: int):
        super().__init__()
        self.scheduler, self.runner = make_engine(64, max_num_batched_tokens)
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.steps_with_prompt_logprobs = 0

    async def generate(self, request: Submit) -> AsyncIterator[RequestOutput]:
        self.submitted.append(request)
        self.outputs[request.request_id] = []
        self.scheduler.add_request(b"c", request)
        while True:
            while not self.outputs[request.request_id]:
                step = self.scheduler.schedule()
                result = self.runner.execute(step.plan)
                self.steps_with_prompt_logprobs += bool(result.prompt_logprobs)
                self.scheduler.update_from_output(step, result)
                for out in self.scheduler.take_outputs().get(b"c", []):
                    self.outputs[out.request_id].append(out)
            output = self.outputs[request.request_id].pop(0)
            yield output
            if output.finish_reason is not None:
                return


@pytest.fixture
async def model_api():
    """(openai client, engine) on the real frontend over ModelEngine, prefilling 8 tokens a step."""
    engine = ModelEngine(8)
    async with TestClient(TestServer(frontend_app(engine))) as client:
        api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused")
        yield api, engine
        await api.close()


def check_against_transformers(prompt_logprobs: list, prompt: list[int], k: int) -> None:
    """One entry per prompt token, the first null; each the prompt token (its logprob and rank) then the k most
    likely with ranks 1..k, as transformers' log_softmax of the whole prompt has them (see ATOL)."""
    reference = reference_log_softmax(prompt)
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position, (entry, token_id) in enumerate(zip(prompt_logprobs[1:], prompt[1:])):
        row = reference[position]
        top = row.topk(k)
        own = entry[str(token_id)]
        assert list(entry)[0] == str(token_id)  # the prompt token first
        assert math.isclose(own["logprob"], row[token_id].item(), abs_tol=ATOL)
        assert (row > row[token_id] + ATOL).sum() < own["rank"] <= (row >= row[token_id] - ATOL).sum()
        assert own["decoded_token"] == TOKENIZER.token_text(token_id)[0]
        listed = {int(t): v for t, v in entry.items() if int(t) != token_id or v["rank"] <= k}
        assert sorted(listed, key=lambda t: listed[t]["rank"]) == top.indices.tolist()
        assert [v["rank"] for v in sorted(listed.values(), key=lambda v: v["rank"])] == list(range(1, k + 1))
        assert torch.allclose(torch.tensor([listed[t]["logprob"] for t in top.indices.tolist()]), top.values,
                              atol=ATOL)
        assert len(entry) == (k if token_id in top.indices.tolist() else k + 1)


async def test_completions_prompt_logprobs_equal_transformers_over_prefill_chunks(model_api):
    api, engine = model_api
    result = await api.completions.create(model=SERVED, prompt=STORY, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 3})
    prompt = hf_tokenizer()(STORY).input_ids
    assert engine.steps_with_prompt_logprobs == math.ceil((len(prompt) - 1) / 8) > 1
    choice = result.choices[0]
    check_against_transformers(choice.model_extra["prompt_logprobs"], prompt, 3)
    assert choice.logprobs is None  # the choice's own logprobs were not asked for


async def test_chat_prompt_logprobs_sit_beside_the_choices(model_api):
    api, engine = model_api
    result = await api.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": STORY}],
                                               max_tokens=2, temperature=0, n=2, extra_body={"prompt_logprobs": 2})
    prompt = engine.submitted[0].prompt_token_ids
    assert [s.prompt_token_ids for s in engine.submitted] == [prompt, prompt]
    check_against_transformers(result.model_extra["prompt_logprobs"], prompt, 2)
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in result.choices)


async def test_prompt_logprobs_zero_lists_the_prompt_token_alone(model_api):
    api, _ = model_api
    result = await api.completions.create(model=SERVED, prompt=PROMPT_IDS, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    entries = result.choices[0].model_extra["prompt_logprobs"]
    assert [list(e) if e else e for e in entries] == [None] + [[str(t)] for t in PROMPT_IDS[1:]]
    assert [e["403"]["decoded_token"] for e in entries[1:2]] == [" Once"]  # its vocabulary piece, space and all


# ---- the request's checks (vLLM's messages) and the shape, over the FakeEngine ------------------------------------

@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
@pytest.mark.parametrize("extra, message", [
    ({"prompt_logprobs": 1, "stream": True}, "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": -1, "stream": True}, "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": -2}, "`prompt_logprobs` must be a positive value or -1."),
    ({"prompt_logprobs": 21}, "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    ({"prompt_logprobs": -1},
     "Requested prompt logprobs of -1 (the whole vocabulary, 512), which is greater than max allowed: 20"),
    ({"prompt_logprobs": 1.5}, None),
])
async def test_prompt_logprobs_out_of_range_are_refused(path, body, extra, message):
    async with served() as (client, engine):
        status, result = await post(client, path, {**body, **extra})
        assert (status, result["error"]["param"]) == (400, "prompt_logprobs")
        if message is not None:
            assert result["error"]["message"] == message
        assert engine.submitted == []


async def test_stream_takes_prompt_logprobs_zero_and_computes_nothing():
    async with served() as (client, engine):
        for path, body in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            async with client.post(path, json={**body, "stream": True, "prompt_logprobs": 0}) as response:
                assert response.status == 200 and "prompt_logprobs" not in await response.text()
            assert engine.submitted[-1].sampling.prompt_logprobs is None  # nothing shows them: no cache bypass


@pytest.mark.parametrize("max_logprobs", [1000, 512, -1])
def test_minus_one_asks_for_the_whole_vocabulary_under_a_large_or_no_max_logprobs(max_logprobs):
    limit = logprobs_limit(max_logprobs, vocab_size=512)
    assert prompt_logprobs_of(-1, False, limit, vocab_size=512) == 512
    assert prompt_logprobs_of(0, True, limit, vocab_size=512) == 0
    assert prompt_logprobs_of(None, True, limit, vocab_size=512) is None
    with pytest.raises(InvalidRequestError, match="greater than max allowed: 512"):  # not clipped to the vocabulary
        prompt_logprobs_of(513, False, limit, vocab_size=512)


async def test_echo_with_logprobs_shows_its_own_k_beside_prompt_logprobs():
    """vLLM: prompt_logprobs sets how many alternatives the engine computes; the echo's logprobs object still shows
    its own `logprobs` k of them, and the choice's prompt_logprobs all of them."""
    async with served() as (client, engine):
        status, result = await post(client, "/v1/completions", {"prompt": PROMPT_IDS, "echo": True, "logprobs": 1,
                                                                  "prompt_logprobs": 3, "max_tokens": 1})
        assert status == 200, result
        assert engine.submitted[-1].sampling.prompt_logprobs == 3
        choice = result["choices"][0]
        (best_id, best), (second_id, second), (third_id, third) = TOP
        echo_top = choice["logprobs"]["top_logprobs"][1]  # the most likely, then the prompt token (its echoed text)
        assert list(echo_top.values()) == [best, sampled_logprob(0)] and TOKENIZER.token_text(best_id)[0] in echo_top
        decoded = [TOKENIZER.token_text(t)[0] for t, _ in TOP]
        assert choice["prompt_logprobs"][:2] == [None, {
            "403": {"logprob": sampled_logprob(0), "rank": 4, "decoded_token": " Once"},
            str(best_id): {"logprob": best, "rank": 1, "decoded_token": decoded[0]},
            str(second_id): {"logprob": second, "rank": 2, "decoded_token": decoded[1]},
            str(third_id): {"logprob": third, "rank": 3, "decoded_token": decoded[2]}}]
        # echo + logprobs alone: the choice's prompt_logprobs have the logprobs' k (vLLM's interplay)
        status, result = await post(client, "/v1/completions", {"prompt": PROMPT_IDS, "echo": True, "logprobs": 1,
                                                                  "max_tokens": 1})
        lengths = [len(e) for e in result["choices"][0]["prompt_logprobs"][1:]]
        assert lengths == [1 if t == best_id else 2 for t in PROMPT_IDS[1:]] == [2, 2, 1, 2]  # 261 is the best


async def test_tokens_as_token_ids_name_the_decoded_tokens():
    engine = FakeEngine()
    async with TestClient(TestServer(frontend_app(engine, api=ApiConfig(return_tokens_as_token_ids=True)))) as client:
        status, result = await post(client, "/v1/completions", {"prompt": PROMPT_IDS, "prompt_logprobs": 0,
                                                                  "max_tokens": 1})
        assert status == 200, result
        assert result["choices"][0]["prompt_logprobs"][1] == {
            "403": {"logprob": sampled_logprob(0), "rank": 4, "decoded_token": "token_id:403"}}
