"""Everything that stands for the engine conforms to frontend.engine_api.Engine: the Router (every serving group), one
serving group alone (the EngineClient) and the tests' one fake (tests/fake_engine.py); and the EngineClient shows
nothing public beyond that interface and what the Router asks of each of its groups."""

import inspect

from shuttle.frontend.engine.api import Engine
from shuttle.frontend.engine.client import EngineClient, ServingGroup
from shuttle.frontend.engine.router import Router
from tests.fake_engine import FakeEngine

# what the Router asks of each group besides Engine: its life, its standing, and its counts for routing
GROUP_API = {"start", "close", "wait_up", "is_up", "group_state", "times_down", "routed"}


def engine_members() -> tuple[set[str], set[str]]:
    """(data members, methods) the Protocol declares."""
    data = set(Engine.__annotations__)
    declared = {name for name in vars(Engine) if not name.startswith("_")}
    properties = {name for name in declared if isinstance(vars(Engine)[name], property)}
    return data | properties, declared - properties


def test_the_protocol_declares_what_the_frontend_uses():
    data, methods = engine_members()
    assert data == {"draining", "on_stats", "info", "stats", "down_reason", "num_in_flight"}
    assert methods == {"group_states", "admission_error", "refusal_retry_after", "generate", "fail_all",
                       "engine_down"}


async def test_the_router_a_serving_group_and_the_fake_are_engines(tmp_path):
    client = EngineClient(f"ipc://{tmp_path}/requests.sock")
    fake = FakeEngine()
    router = Router([client, fake])
    try:
        for engine in (router, client, fake):
            assert isinstance(engine, Engine), type(engine).__name__
        assert all(isinstance(group, ServingGroup) for group in router.groups)
    finally:
        router.close()


def test_each_method_takes_the_protocols_parameters():
    _, methods = engine_members()
    for name in methods:
        expected = list(inspect.signature(getattr(Engine, name)).parameters)
        for cls in (Router, ServingGroup, EngineClient, FakeEngine):
            assert list(inspect.signature(getattr(cls, name)).parameters) == expected, (cls.__name__, name)


async def test_the_engine_client_shows_only_the_engine_and_the_group_api(tmp_path):
    client = EngineClient(f"ipc://{tmp_path}/requests.sock")
    try:
        public = {name for name in dir(client) if not name.startswith("_")}
        data, methods = engine_members()
        assert public == data | methods | GROUP_API
    finally:
        client.close()
