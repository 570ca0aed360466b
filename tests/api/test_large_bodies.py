"""Large request bodies never stall the frontend's event loop: their conversion to a Call (decoding, the chat
template, tokenizing) runs in frontend/web/off_loop.py's pool, and is linear in the body (40,000 function_call items
in one /v1/responses body took about 30 s of the loop before, when each call copied the tool-call list), so the
streams beside them go on and each ends with its terminal event."""

import asyncio
import json
import threading

from shuttle.frontend.responses import routes as responses_routes
from shuttle.frontend.responses.request import input_messages
from shuttle.frontend.web.off_loop import OFF_LOOP_BYTES
from tests.api.test_api_details import STORY, served, stream
from tests.fake_engine import FakeEngine


def calls_body(num_calls: int) -> dict:
    items = [{"type": "message", "role": "user", "content": "What is the weather?"}]
    items += [{"type": "function_call", "call_id": f"call_{i}", "name": "get_weather", "arguments": "{}"}
              for i in range(num_calls)]
    return {"model": "stories", "input": items, "max_output_tokens": 4}


def test_consecutive_function_calls_join_one_assistant_message():
    messages = input_messages(None, calls_body(40_000)["input"])
    assert [m.role for m in messages] == ["user", "assistant"]
    assert [c.id for c in messages[1].tool_calls] == [f"call_{i}" for i in range(40_000)]


async def test_a_large_body_converts_off_the_loop_while_other_streams_finish(monkeypatch):
    threads = {}  # number of input items -> the thread that made the call

    class Recorded(responses_routes.ResponsesCall):
        def __init__(self, state, request, previous=None):
            threads[len(request.input)] = threading.current_thread()
            super().__init__(state, request, previous)
    monkeypatch.setattr(responses_routes, "ResponsesCall", Recorded)
    big = json.dumps(calls_body(40_000)).encode()
    small = json.dumps(calls_body(1)).encode()
    assert len(small) < OFF_LOOP_BYTES <= len(big)
    async with served(FakeEngine(script=STORY, step_delay=0.02)) as (client, _):
        async def post(raw: bytes) -> int:
            async with client.post("/v1/responses", data=raw, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                return r.status

        streams = [asyncio.create_task(stream(client, "/v1/completions", {"prompt": "Once", "max_tokens": 16}))
                   for _ in range(10)]
        statuses = await asyncio.gather(post(big), post(small))
        ended = await asyncio.gather(*streams)
    assert statuses[1] == 200 and statuses[0] in (200, 400)  # 400: the rendered prompt exceeds the context
    assert [events[-1]["choices"][0]["finish_reason"] for events in ended] == ["length"] * 10
    assert threads[40_001].name.startswith("convert-request") and threads[2] is threading.main_thread()
