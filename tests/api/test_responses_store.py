"""Issue 43, the Responses API with state: the bounded store (--responses-store-max-entries, --responses-store-max-age;
oldest out first; `store: false` keeps a response out), previous_response_id (the stored conversation, then the new
input), GET / DELETE /v1/responses/{id}, `background: true` with POST /v1/responses/{id}/cancel, and that a
background response ends with exactly one terminal status whether its client stays, leaves, cancels it or the
server drains. In process, over the scripted engine (tests/fake_engine.py), with the official `openai` client; end
to end on the shared `server` (stories260K), a continued and a background response equal the chat endpoint's greedy
output.
"""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from shuttle.common.config import ApiConfig
from shuttle.common.errors import InvalidRequestError
from shuttle.common.messages import FinishReason
from shuttle.frontend.lifecycle import drain
from shuttle.frontend.responses import background
from shuttle.frontend.responses.api import ResponsesCall
from shuttle.frontend.responses.request import ResponsesRequest
from shuttle.frontend.responses.store import ResponseNotFoundError, ResponseStore
from shuttle.frontend.state import STATE
from tests.api.test_api_details import PROMPT, STORY, STORY_TEXT, openai_client, post, served
from tests.api.test_responses_api import TOOLS, events_of, served_tools
from tests.api.test_tool_calling import NAMED_TEXT, script
from tests.fake_engine import FakeEngine, frontend_app

URL = "/v1/responses"


def store_of(client: TestClient) -> ResponseStore:
    return client.server.app[STATE].responses


async def until(client: TestClient, response_id: str, *statuses: str) -> dict:
    """GET the response until its status is one of `statuses` (within 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        async with client.get(f"{URL}/{response_id}") as answer:
            assert answer.status == 200, await answer.text()
            body = await answer.json()
        if body["status"] in statuses or time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.01)


def not_found(response_id: str) -> str:
    return f"Response with id '{response_id}' not found."


# ---- the store ---------------------------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_store_evicts_the_oldest_beyond_its_count_and_its_age():
    clock = Clock()
    store = ResponseStore(max_entries=2, max_age=10.0, clock=clock)
    for name in ("a", "b", "c"):
        store.put({"id": name, "status": "completed", "output": []}, [])
        clock.now += 4
    assert len(store) == 2  # a went when c came
    with pytest.raises(ResponseNotFoundError) as missing:
        store.get("a", "previous_response_id")
    assert (missing.value.status, missing.value.param, str(missing.value)) == (404, "previous_response_id",
                                                                                not_found("a"))
    # now 112: b (stored at 104) is 8 s old, c (108) 4 s
    assert store.get("b").stored_at == 104.0
    clock.now = 114.0  # b is 10 s old: gone; c stays
    with pytest.raises(ResponseNotFoundError):
        store.get("b")
    assert store.get("c").response["id"] == "c" and len(store) == 1
    clock.now = 118.0
    assert len(store) == 0


def test_a_response_ages_from_its_end_and_never_by_age_while_it_runs():
    clock = Clock()
    store = ResponseStore(max_entries=10, max_age=10.0, clock=clock)
    running = store.put({"id": "bg", "status": "queued", "output": []}, [])
    store.put({"id": "a", "status": "completed", "output": []}, [])
    clock.now += 4
    store.put({"id": "b", "status": "completed", "output": []}, [])
    clock.now += 26  # 130: bg is 30 s in the store and still running; a and b are older than 10 s
    running.settle({"id": "bg", "status": "in_progress", "output": []})
    assert [store.get("bg").status, len(store)] == ["in_progress", 1]
    running.settle({"id": "bg", "status": "completed", "output": []})  # it ends at 130: its age starts
    clock.now = 139.0
    assert store.get("bg").stored_at == 130.0
    clock.now = 140.0
    with pytest.raises(ResponseNotFoundError):
        store.get("bg")


def test_no_age_limit_and_a_store_of_nothing():
    clock = Clock()
    store = ResponseStore(max_entries=1, max_age=0.0, clock=clock)
    store.put({"id": "a", "status": "completed", "output": []}, [])
    clock.now += 1e9
    assert store.get("a").response["id"] == "a"
    with pytest.raises(InvalidRequestError):
        ResponseStore(max_entries=0, max_age=0.0).put({"id": "a"}, [])


def test_the_store_evicts_the_oldest_beyond_its_bytes_but_keeps_the_newest():
    store = ResponseStore(max_entries=10, max_age=0.0, max_bytes=100)
    for name, size in (("a", 60), ("b", 30), ("c", 20)):
        store.put({"id": name, "status": "completed", "output": []}, [], body_bytes=size)
    assert [store.get(n).body_bytes for n in ("b", "c")] == [30, 20] and store.body_bytes == 50 and len(store) == 2
    store.put({"id": "big", "status": "completed", "output": []}, [], body_bytes=500)
    assert len(store) == 1 and store.get("big") and store.body_bytes == 500


async def test_the_store_counts_each_request_body_once():
    async with served() as (client, _):
        raw = json.dumps({"input": PROMPT}).encode()
        headers = {"Content-Type": "application/json"}
        async with client.post(URL, data=raw, headers=headers) as answer:
            first = await answer.json()
        continued = json.dumps({"input": "more", "previous_response_id": first["id"]}).encode()
        async with client.post(URL, data=continued, headers=headers) as answer:
            second = await answer.json()
        store = store_of(client)
        assert store.body_bytes == len(raw) + len(continued)
        assert (store.get(first["id"]).size, store.get(second["id"]).size) == (len(raw), len(raw) + len(continued))
        async with client.delete(f"{URL}/{first['id']}"):
            pass
        assert store.body_bytes == len(continued)


async def test_a_stored_response_is_retrieved_as_it_was_answered():
    async with served() as (client, _):
        api = openai_client(client)
        created = await api.responses.create(model="stories", input=PROMPT, metadata={"k": "v"})
        retrieved = await api.responses.retrieve(created.id)
        status, raw = await post(client, URL, {"input": PROMPT})
        async with client.get(f"{URL}/{raw['id']}") as answer:
            assert answer.status == 200
            assert await answer.json() == raw
    assert created.store is True and created.output_text == STORY_TEXT
    assert retrieved.model_dump() == created.model_dump()


async def test_a_streamed_response_is_stored_as_its_last_event_says():
    async with served() as (client, _):
        events = await events_of(client, {"input": PROMPT})
        done = events[-1][1]["response"]
        async with client.get(f"{URL}/{done['id']}") as answer:
            assert answer.status == 200
            assert await answer.json() == done
        cut = await events_of(client, {"input": PROMPT, "store": False})
        async with client.get(f"{URL}/{cut[-1][1]['response']['id']}") as answer:
            assert answer.status == 404
    assert events[-1][0] == "response.completed" and done["store"] is True
    assert done["output"][0]["content"][0]["text"] == STORY_TEXT


async def test_store_false_keeps_a_response_out():
    async with served() as (client, _):
        api = openai_client(client)
        created = await api.responses.create(model="stories", input=PROMPT, store=False)
        with pytest.raises(openai.NotFoundError) as missing:
            await api.responses.retrieve(created.id)
        assert len(store_of(client)) == 0
    assert created.store is False and created.status == "completed"
    assert missing.value.body["message"] == not_found(created.id)


async def test_a_server_that_stores_nothing_answers_store_false_and_refuses_background():
    async with served(api=ApiConfig(responses_store_max_entries=0)) as (client, engine):
        status, body = await post(client, URL, {"input": PROMPT})
        assert status == 200 and body["store"] is False
        async with client.get(f"{URL}/{body['id']}") as answer:
            assert answer.status == 404
        status, refused = await post(client, URL, {"input": PROMPT, "background": True})
    assert status == 400 and refused["error"]["param"] == "background"
    assert "--responses-store-max-entries 0" in refused["error"]["message"] and len(engine.submitted) == 1


async def test_the_oldest_response_is_evicted_by_count_and_then_answers_404():
    async with served(api=ApiConfig(responses_store_max_entries=2)) as (client, engine):
        api = openai_client(client)
        ids = [(await api.responses.create(model="stories", input=PROMPT)).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError) as gone:
            await api.responses.retrieve(ids[0])
        assert [(await api.responses.retrieve(i)).id for i in ids[1:]] == ids[1:]
        status, body = await post(client, URL, {"input": "more", "previous_response_id": ids[0]})
    assert gone.value.body["message"] == not_found(ids[0])
    assert status == 404 and body["error"] == {"message": not_found(ids[0]), "type": "not_found_error",
                                               "param": "previous_response_id", "code": 404}
    assert len(engine.submitted) == 3  # the refused continuation never reached the engine


async def test_a_response_older_than_the_max_age_is_evicted():
    clock = Clock()
    async with served(api=ApiConfig(responses_store_max_age=60.0)) as (client, _):
        store_of(client).clock = clock
        api = openai_client(client)
        old = await api.responses.create(model="stories", input=PROMPT)
        clock.now += 30
        young = await api.responses.create(model="stories", input=PROMPT)
        clock.now += 30  # old is 60 s old, young 30 s
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(old.id)
        assert (await api.responses.retrieve(young.id)).id == young.id
        clock.now += 30
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(young.id)


async def test_a_background_response_running_longer_than_the_max_age_is_kept_and_ages_from_its_end():
    clock = Clock()
    async with served(FakeEngine(script=STORY, step_delay=0.05), api=ApiConfig(responses_store_max_age=60.0)) \
            as (client, engine):
        store_of(client).clock = clock
        _, queued = await post(client, URL, {"input": PROMPT, "background": True})
        await until(client, queued["id"], "in_progress")
        clock.now += 600  # it runs ten times the max age (on the store's clock)
        running = await until(client, queued["id"], "in_progress")
        done = await until(client, queued["id"], "completed")
        clock.now += 59
        kept = await until(client, queued["id"], "completed")
        clock.now += 1
        async with client.get(f"{URL}/{queued['id']}") as answer:
            gone = answer.status
    assert running["status"] == "in_progress" and done["status"] == kept["status"] == "completed"
    assert gone == 404 and engine.aborted == []


async def test_delete_forgets_a_response():
    async with served() as (client, _):
        api = openai_client(client)
        created = await api.responses.create(model="stories", input=PROMPT)
        async with client.delete(f"{URL}/{created.id}") as answer:
            assert answer.status == 200
            assert await answer.json() == {"id": created.id, "object": "response", "deleted": True}
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(created.id)
        async with client.delete(f"{URL}/{created.id}") as again:
            assert again.status == 404


@pytest.mark.parametrize("query, param", [("stream=true", "stream"), ("starting_after=3", "starting_after"),
                                          ("include=x", "include")])
async def test_retrieve_refuses_the_query_parameters_it_does_not_serve(query, param):
    async with served() as (client, _):
        _, created = await post(client, URL, {"input": PROMPT})
        async with client.get(f"{URL}/{created['id']}?{query}") as answer:
            body = await answer.json()
            assert answer.status == 400 and body["error"]["param"] == param, body
        async with client.get(f"{URL}/{created['id']}?stream=false") as answer:
            assert answer.status == 200


# ---- previous_response_id ----------------------------------------------------------------------------------------

async def test_previous_response_id_continues_the_stored_conversation():
    """The new request's instructions, then the previous turns' input and output, then the new input: the prompt
    of the chat request that says the same (the previous instructions are not carried over, as OpenAI's)."""
    async with served() as (client, engine):
        api = openai_client(client)
        first = await api.responses.create(model="stories", instructions="Be kind.", input="Tom had a ball.")
        second = await api.responses.create(model="stories", instructions="Be brief.", input="And then?",
                                            previous_response_id=first.id)
        third = await api.responses.create(model="stories", input=[{"role": "user", "content": "The end?"}],
                                           previous_response_id=second.id, stream=False)
        for messages in ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tom had a ball."},
                          {"role": "assistant", "content": STORY_TEXT}, {"role": "user", "content": "And then?"}],
                         [{"role": "user", "content": "Tom had a ball."},
                          {"role": "assistant", "content": STORY_TEXT}, {"role": "user", "content": "And then?"},
                          {"role": "assistant", "content": STORY_TEXT}, {"role": "user", "content": "The end?"}]):
            status, _ = await post(client, "/v1/chat/completions", {"messages": messages})
            assert status == 200
    prompts = [r.prompt_token_ids for r in engine.submitted]
    assert prompts[1] == prompts[3] and prompts[2] == prompts[4] and len(prompts[2]) > len(prompts[1])
    assert (second.previous_response_id, third.previous_response_id) == (first.id, second.id)
    assert first.previous_response_id is None and third.output_text == STORY_TEXT


async def chat_of_the_answered_call(client, call_id: str) -> int:
    """POST the chat request that says what a stored get_weather call `call_id` (NAMED_TEXT) answered "sunny"
    continues: the user's question, the call, the answer. Returns its status."""
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": NAMED_TEXT}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
    status, _ = await post(client, "/v1/chat/completions", {"messages": messages, "tools": [
        {"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}},
        {"type": "function", "function": {"name": "get_time"}}], "tool_choice": "none"})
    return status


async def test_a_function_call_output_continues_the_stored_call():
    async with served_tools(NAMED_TEXT) as (client, engine):
        status, called = await post(client, URL, {"input": "Weather?", "tools": TOOLS,
                                                  "tool_choice": {"type": "function", "name": "get_weather"}})
        assert status == 200, called
        [call] = called["output"]
        status, body = await post(client, URL, {"previous_response_id": called["id"], "tools": TOOLS,
                                                "tool_choice": "none", "input": [
                                                    {"type": "function_call_output", "call_id": call["call_id"],
                                                     "output": "sunny"}]})
        assert status == 200, body
        assert await chat_of_the_answered_call(client, call["call_id"]) == 200
    assert call["type"] == "function_call" and call["arguments"] == NAMED_TEXT
    assert engine.submitted[1].prompt_token_ids == engine.submitted[2].prompt_token_ids


async def test_an_unknown_previous_response_id_is_404_naming_it():
    async with served() as (client, engine):
        api = openai_client(client)
        with pytest.raises(openai.NotFoundError) as missing:
            await api.responses.create(model="stories", input=PROMPT, previous_response_id="resp_nope")
        status, _ = await post(client, URL, {"input": PROMPT, "previous_response_id": "resp_nope", "stream": True})
    assert missing.value.body["message"] == not_found("resp_nope")
    assert missing.value.body["param"] == "previous_response_id"
    assert status == 404 and engine.submitted == []


# ---- background --------------------------------------------------------------------------------------------------

async def test_a_background_response_is_answered_queued_and_runs_to_its_end():
    async with served(FakeEngine(script=STORY, step_delay=0.05)) as (client, engine):
        api = openai_client(client)
        queued = await api.responses.create(model="stories", input=PROMPT, background=True)
        running = await api.responses.retrieve(queued.id)
        done = await until(client, queued.id, "completed")
        _, foreground = await post(client, URL, {"input": PROMPT})
    assert (queued.status, queued.background, queued.output, queued.usage) == ("queued", True, [], None)
    assert running.status == "in_progress" and running.output == []
    assert done["status"] == "completed" and done["background"] is True and done["error"] is None
    assert done["output"][0]["content"][0]["text"] == STORY_TEXT
    assert done["usage"] == foreground["usage"] and done["usage"]["output_tokens"] == len(STORY) + 1
    assert engine.aborted == []


async def test_a_background_response_that_fails_says_why():
    async with served(FakeEngine(error=(500, "the model failed"))) as (client, _):
        api = openai_client(client)
        queued = await api.responses.create(model="stories", input=PROMPT, background=True)
        failed = await until(client, queued.id, "failed")
    assert failed["error"] == {"code": "server_error", "message": "the model failed"} and failed["output"] == []


async def test_a_background_response_the_engine_has_no_room_for_waits_in_line_queued():
    """The scheduler refuses it at arrival (503: its waiting queue is full) twice: it does not fail but stays queued
    and is submitted again when the Retry-After says, then runs to its end (a foreground request gets the 503)."""
    engine = FakeEngine(script=STORY, error=(503, "the server is at capacity: waiting queue is full"),
                        retry_after_s=0.2)
    async with served(engine) as (client, _):
        status, refused = await post(client, URL, {"input": PROMPT})
        _, queued = await post(client, URL, {"input": PROMPT, "background": True})
        deadline = time.monotonic() + 5
        while len(engine.submitted) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        waiting = await until(client, queued["id"], "queued")
        engine.error = None
        done = await until(client, queued["id"], "completed")
    assert (status, refused["error"]["message"]) == (503, "the server is at capacity: waiting queue is full")
    assert (queued["status"], waiting["status"], waiting["error"]) == ("queued", "queued", None)
    assert done["output"][0]["content"][0]["text"] == STORY_TEXT and done["error"] is None
    assert [r.request_id for r in engine.submitted[1:]][:3] == [f"{queued['id']}-0"] * 3


async def test_a_background_response_with_a_schema_of_no_json_type_is_refused_at_once():
    """`"type": "bogus"` was refused by the engine only, once queued: the foreground got its 400, the background
    response was answered queued and then failed. Now both get the 400 before anything is stored or submitted."""
    text = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": ["string", "bogus"]}}}}}
    async with served() as (client, engine):
        for background in (False, True):
            status, body = await post(client, URL, {"input": PROMPT, "background": background, "text": text})
            assert (status, body["error"]["param"]) == (400, "text"), body
            assert body["error"]["message"].endswith("at /properties/a/type: `type` must be one of string, number, "
                                                     "integer, boolean, object, array, null or a list of them")
        assert len(store_of(client)) == 0 and engine.submitted == []


async def test_background_refusals():
    async with served(FakeEngine(script=STORY, step_delay=0.05)) as (client, engine):
        status, streamed = await post(client, URL, {"input": PROMPT, "background": True, "stream": True})
        assert status == 400 and streamed["error"]["param"] == "stream"
        status, unstored = await post(client, URL, {"input": PROMPT, "background": True, "store": False})
        assert status == 400 and unstored["error"]["param"] == "background"
        status, bad = await post(client, URL, {"input": PROMPT, "background": True, "temperature": -1})
        assert status == 400 and bad["error"]["param"] == "temperature" and len(store_of(client)) == 0
        _, queued = await post(client, URL, {"input": PROMPT, "background": True})
        status, early = await post(client, URL, {"input": "next", "previous_response_id": queued["id"]})
        assert status == 400 and early["error"]["param"] == "previous_response_id"
        assert "is still in_progress" in early["error"]["message"]
        engine.draining = True
        status, draining = await post(client, URL, {"input": PROMPT, "background": True})
        assert status == 503 and len(store_of(client)) == 1
        engine.draining = False
    assert len(engine.submitted) == 1


async def test_cancel_aborts_a_background_response_once():
    async with served(FakeEngine(script=STORY, step_delay=0.1)) as (client, engine):
        api = openai_client(client)
        queued = await api.responses.create(model="stories", input=PROMPT, background=True)
        await until(client, queued.id, "in_progress")
        cancelled = await api.responses.cancel(queued.id)
        retrieved = await api.responses.retrieve(queued.id)
        again = await api.responses.cancel(queued.id)  # idempotent, as OpenAI's
        await asyncio.sleep(0.1)
        later = await api.responses.retrieve(queued.id)
        foreground = await api.responses.create(model="stories", input=PROMPT, max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as synchronous:
            await api.responses.cancel(foreground.id)
        with pytest.raises(openai.NotFoundError):
            await api.responses.cancel("resp_nope")
    assert cancelled.status == retrieved.status == again.status == later.status == "cancelled"
    assert engine.aborted == [f"{queued.id}-0"]
    assert synchronous.value.body["message"] == "Cannot cancel a synchronous response."


async def test_cancel_reads_no_body_so_any_content_type_is_taken():
    """A POST with no body goes out as application/octet-stream (aiohttp's client, curl -X POST): cancel reads none,
    so it is not refused with 415; a body-reading route still is."""
    async with served(FakeEngine(script=STORY, step_delay=0.1)) as (client, _):
        _, queued = await post(client, URL, {"input": PROMPT, "background": True})
        async with client.post(f"{URL}/{queued['id']}/cancel",
                               headers={"Content-Type": "application/octet-stream"}) as answer:
            assert answer.status == 200, await answer.text()
            cancelled = await answer.json()
        async with client.post(URL, data=b"{}", headers={"Content-Type": "application/octet-stream"}) as answer:
            refused = answer.status
    assert cancelled["status"] == "cancelled" and refused == 415


async def test_cancelling_a_finished_background_response_is_refused():
    async with served() as (client, _):
        api = openai_client(client)
        queued = await api.responses.create(model="stories", input=PROMPT, background=True)
        await until(client, queued.id, "completed")
        with pytest.raises(openai.BadRequestError) as refused:
            await api.responses.cancel(queued.id)
        assert (await api.responses.retrieve(queued.id)).status == "completed"
    assert "'completed'" in refused.value.body["message"]


async def test_a_background_response_cancelled_before_it_started_is_cancelled():
    async with served() as (client, engine):
        state = client.server.app[STATE]
        _, queued = await post(client, URL, {"input": PROMPT, "background": True})
        # a second one is cancelled from the loop before its task has run once
        call = ResponsesCall(state, ResponsesRequest(input=PROMPT, background=True))
        response = background.start(call)
        cancelled = await background.cancel(state.responses, response["id"])
        await until(client, queued["id"], "completed")
    assert (response["status"], cancelled["status"]) == ("queued", "cancelled")
    assert [r.request_id for r in engine.submitted] == [f"{queued['id']}-0"]


async def test_a_background_response_whose_client_left_runs_to_its_end():
    """The client sends the request and closes the connection without reading the answer (the server cancels its
    handler, as shuttle serve runs aiohttp): the response still ends, once, completed."""
    engine = FakeEngine(script=STORY, step_delay=0.01)
    server = TestServer(frontend_app(engine), handler_cancellation=True)
    async with TestClient(server) as client:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        body = b'{"input": "Once upon a time", "background": true}'
        writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()
        deadline = time.monotonic() + 5
        while not len(store_of(client)) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        [response_id] = store_of(client)._entries
        done = await until(client, response_id, "completed")
    assert done["output"][0]["content"][0]["text"] == STORY_TEXT and engine.aborted == []


async def test_a_drain_fails_background_responses_still_running():
    async with served(FakeEngine(script=STORY, step_delay=0.1)) as (client, engine):
        api = openai_client(client)
        queued = await api.responses.create(model="stories", input=PROMPT, background=True)
        await until(client, queued.id, "in_progress")
        await drain(engine, 0.05, asyncio.Event(), set())
        failed = store_of(client).get(queued.id).response
    assert failed["status"] == "failed" and engine.num_in_flight == 0
    assert failed["error"] == {"code": "server_error", "message": "the server shut down before this request finished"}


async def test_background_responses_still_running_when_the_server_stops_fail_once():
    async with served(FakeEngine(script=STORY, step_delay=0.1)) as (client, engine):
        api = openai_client(client)
        queued = await api.responses.create(model="stories", input=PROMPT, background=True)
        await until(client, queued.id, "in_progress")
        store = store_of(client)
    entry = store.get(queued.id)
    assert entry.status == "failed" and entry.task is None
    assert entry.response["error"] == {"code": "server_error",
                                       "message": "the server shut down before this response finished"}
    assert engine.aborted == [f"{queued.id}-0"]


async def test_a_running_background_response_evicted_from_the_store_is_aborted():
    async with served(FakeEngine(script=STORY, step_delay=0.1), api=ApiConfig(responses_store_max_entries=1)) \
            as (client, engine):
        api = openai_client(client)
        queued = await api.responses.create(model="stories", input=PROMPT, background=True)
        await until(client, queued.id, "in_progress")
        await api.responses.create(model="stories", input=PROMPT, max_output_tokens=1)
        await asyncio.sleep(0.1)
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(queued.id)
    assert engine.aborted == [f"{queued.id}-0"]


# ---- end to end on stories260K (the shared `server`) ------------------------------------------------------------

def test_a_continued_and_a_background_response_equal_the_chat_endpoints_greedy_output(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    kwargs = dict(model="stories260K", max_output_tokens=12, temperature=0)
    first = client.responses.create(input="Tom had a ball.", **kwargs)
    second = client.responses.create(input="What did Tom do?", previous_response_id=first.id, **kwargs)
    chat = client.chat.completions.create(model="stories260K", max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": "Tom had a ball."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What did Tom do?"}])
    assert second.output_text == chat.choices[0].message.content and second.output_text
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    queued = client.responses.create(input="Tom had a ball.", background=True, **kwargs)
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress") and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert queued.status == "queued" and done.status == first.status and done.output_text == first.output_text
    assert client.responses.retrieve(second.id).output_text == second.output_text


async def test_a_call_cut_off_by_max_output_tokens_is_left_out_when_the_conversation_goes_on():
    """A fresh-clone trial: the response's last call, cut off by the length limit, is an "incomplete" item whose
    arguments are no JSON object; continuing the stored response (or sending its output back) was refused with
    "input[-1].arguments must be a JSON object as text", which no client could mend. The cut call is left out of
    the continued conversation: the prompt is the chat request's with the whole call alone."""
    cut = '[{"name": "get_weather", "parameters": ' + NAMED_TEXT + '}, {"name": "get_time", "parameters": {"tz'
    engine = FakeEngine(script=script(cut, eos=False), script_end=FinishReason.LENGTH)  # the length limit cuts it
    async with served(engine, template="tools_chat.jinja") as (client, engine):
        status, called = await post(client, URL, {"input": "Weather?", "tools": TOOLS, "tool_choice": "required"})
        assert status == 200, called
        assert called["status"] == "incomplete", called
        whole, broken = called["output"]
        assert (whole["arguments"], whole["status"]) == (NAMED_TEXT, "completed")
        assert (broken["name"], broken["arguments"], broken["status"]) == ("get_time", '{"tz', "incomplete")
        answer = {"type": "function_call_output", "call_id": whole["call_id"], "output": "sunny"}
        status, body = await post(client, URL, {"previous_response_id": called["id"], "tools": TOOLS,
                                                "tool_choice": "none", "input": [answer]})
        assert status == 200, body
        status, body = await post(client, URL, {"tools": TOOLS, "tool_choice": "none", "input": [
            {"role": "user", "content": "Weather?"}, *called["output"], answer]})
        assert status == 200, body
        assert await chat_of_the_answered_call(client, whole["call_id"]) == 200
    assert engine.submitted[1].prompt_token_ids == engine.submitted[2].prompt_token_ids == \
        engine.submitted[3].prompt_token_ids
