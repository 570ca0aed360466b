"""POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter: LoRA adapters added and removed at run time, under
vLLM's rule: the routes exist only with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING set to true (or 1), and
take the API key as every /v1 route does.

The frontend's registry (FrontendState.lora_modules) is the one list of served adapters: each request carries its
adapter's name and directory to the scheduler, which loads the adapter into a slot when a request first needs it
(scheduler/lora_slots.py). A load is checked here as a launch checks --lora-modules, and its weights against the
served model's layers (their shapes read from its safetensors headers), so an adapter the model cannot take is a
400 now, not a failed request later. An unloaded adapter is gone for new requests; those already queued or running
finish through it.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import msgspec
from aiohttp import web

from shuttle.common.errors import InvalidRequestError, ModelDirError, ModelNotFoundError
from shuttle.common.lora import LoRAModule, adapter_name_error, check_adapter_for
from shuttle.frontend.request.decoding import decode_body
from shuttle.frontend.state import STATE, FrontendState
from shuttle.frontend.web.server import request_body

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's body: the name requests will give as their model, and the PEFT directory."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's body: the adapter's name (vLLM's lora_int_id is refused: shuttle numbers no adapter)."""

    lora_name: str


def runtime_updates_allowed() -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING's rule: true or 1, any case."""
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


def add_lora_routes(app: web.Application, state: FrontendState) -> None:
    """The two routes, when --enable-lora and the environment allow them."""
    if state.config.lora.enable_lora and runtime_updates_allowed():
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)


async def load_lora_adapter(request: web.Request) -> web.Response:
    """Add an adapter. Raises InvalidRequestError (400): the name is taken, or the adapter cannot be served."""
    state = request.app[STATE]
    body = decode_body(await request_body(request), LoadLoRAAdapterRequest)
    name = body.lora_name
    if not name or not body.lora_path:
        raise InvalidRequestError("lora_name and lora_path must not be empty", param="lora_name")
    why = adapter_name_error(name)
    if why is not None:
        raise InvalidRequestError(why, param="lora_name")
    if name in state.config.model.served_model_names:
        raise InvalidRequestError(f"lora_name {name!r} is the served model's name", param="lora_name")
    if name in state.lora_modules:
        raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    path = str(Path(body.lora_path).absolute())
    try:
        await asyncio.to_thread(check_adapter_for, state.config.model.model_dir, path,
                                state.config.lora.max_lora_rank)
    except ModelDirError as exc:
        raise InvalidRequestError(str(exc), param="lora_path") from None
    if name in state.lora_modules:  # another load of the name finished while this one was checked
        raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    state.lora_modules[name] = LoRAModule(name=name, path=path, load_id=uuid.uuid4().hex)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """Remove an adapter. Raises ModelNotFoundError (404): no adapter of that name."""
    state = request.app[STATE]
    body = decode_body(await request_body(request), UnloadLoRAAdapterRequest)
    if state.lora_modules.pop(body.lora_name, None) is None:
        raise ModelNotFoundError(f"The lora adapter '{body.lora_name}' cannot be found.")
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
