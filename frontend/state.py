"""What the frontend's handlers share: configuration, the engine client and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from shuttle.common.config import ShuttleConfig
from shuttle.common.lora import LoRAModule
from shuttle.frontend.engine.api import Engine
from shuttle.frontend.observability.metrics import Metrics
from shuttle.frontend.reasoning import ReasoningParser, reasoning_parser_of
from shuttle.frontend.request.chat_template import ChatTemplate
from shuttle.frontend.responses.store import ResponseStore
from shuttle.frontend.tokenizer import TextTokenizer


@dataclass
class FrontendState:
    config: ShuttleConfig
    engine: Engine  # the Router over every serving group (tests: tests/fake_engine.py's FakeEngine)
    tokenizer: TextTokenizer
    chat_template: ChatTemplate
    metrics: Metrics
    websockets: set[web.WebSocketResponse] = field(default_factory=set)  # open ones, closed at the end of a drain
    responses: ResponseStore = field(init=False)  # the Responses API's stored responses (--responses-store-*)
    reasoning: ReasoningParser | None = field(init=False)  # --reasoning-parser, when the tokenizer has its tags
    # the LoRA adapters requests may name, by name: --lora-modules, then loaded and unloaded at run time
    lora_modules: dict[str, LoRAModule] = field(init=False)

    def __post_init__(self):
        api = self.config.api
        self.responses = ResponseStore(api.responses_store_max_entries, api.responses_store_max_age)
        self.reasoning = reasoning_parser_of(api.reasoning_parser, self.tokenizer)
        lora = self.config.lora
        self.lora_modules = {m.name: m for m in lora.lora_modules} if lora.enable_lora else {}

    @property
    def model_name(self) -> str:
        return self.config.model.served_model_name


STATE = web.AppKey("shuttle_state", FrontendState)
# The id of the response a handler creates (cmpl-..., chatcmpl-...): the x-request-id header when the client sent none
RESPONSE_ID = web.RequestKey("shuttle_response_id", str)
