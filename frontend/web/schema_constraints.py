"""The checks the code makes beyond the request Structs' types, told to /openapi.json's JSON Schemas: ranges, the shapes
of a prompt, the served model name, the chat roles, and that no other field is taken (additionalProperties false) but
for the one accepted value of a field of OpenAI's or vLLM's schema that shuttle does not implement
(frontend/request/decoding.py's REFUSED_FIELDS: `"echo": false` on chat, `"skip_special_tokens": true`). So a request
drawn from the document (a client generator, scripts/dev/fuzz_schema.py) is one the server takes, but for what these
schemas do not say: prompt plus max_tokens within max_model_len, min_tokens at most max_tokens, best_of equal to n, at
most one output constraint (and none with min_tokens or ignore_eos), a schema given as text being JSON, tool_choice
naming a listed tool (and "auto", the default beside tools, only on a server started with --enable-auto-tool-choice),
tool-call arguments that are JSON objects as text.

The limits come from where they are checked (common/sampling.py, frontend/request/params.py,
frontend/request/chat_template.py); the fuzzer's count of schema-valid requests refused is what shows a drift.
"""

from __future__ import annotations

from shuttle.common.sampling import MAX_LOGPROBS
from shuttle.frontend.request.chat_template import RESERVED_KWARGS, ROLES
from shuttle.frontend.request.decoding import REFUSED_FIELDS
from shuttle.frontend.request.protocol import MAX_N, MAX_PROMPTS
from shuttle.frontend.structured.request import BACKENDS, MAX_CHOICES, REFUSED_KEYS

NULL = {"type": "null"}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, NULL]}


def _int(low: int | None = None, high: int | None = None) -> dict:
    return {"type": "integer", **({"minimum": low} if low is not None else {}),
            **({"maximum": high} if high is not None else {})}


def _number(low: float, high: float, exclusive_low: bool = False) -> dict:
    return {"type": "number", ("exclusiveMinimum" if exclusive_low else "minimum"): low, "maximum": high}


def _model(model_name: str, any_model: bool) -> dict:
    """A request's `model`: the served name, or any string where LoRA adapters (loaded at run time too) are served."""
    return _nullable({"type": "string"} if any_model else {"const": model_name})


def _sampling(model_name: str, vocab_size: int, any_model: bool = False) -> dict[str, dict]:
    """Both completion endpoints' fields (SamplingFields; SamplingParams.validate and sampling_params check them)."""
    token = _int(0, vocab_size - 1)
    stop_text = {"type": "string", "minLength": 1}
    return {
        "model": _model(model_name, any_model),
        "max_tokens": _nullable(_int(1)),
        "temperature": _number(0, 100), "top_p": _number(0, 1, exclusive_low=True), "top_k": _int(-1, 2**31 - 1),
        "min_p": _number(0, 1), "seed": _nullable(_int(-(2**63), 2**64 - 1)), "n": _int(1, MAX_N),
        "stop": {"anyOf": [stop_text, {"type": "array", "items": stop_text, "maxItems": 16}, NULL]},
        "stop_token_ids": _nullable({"type": "array", "items": token}), "min_tokens": _int(0),
        "presence_penalty": _number(-2, 2), "frequency_penalty": _number(-2, 2),
        "repetition_penalty": _number(0, 10, exclusive_low=True),
        "logit_bias": _nullable({"type": "object", "propertyNames": {"pattern": "^(0|[1-9][0-9]*)$"},
                                 "additionalProperties": _number(-100, 100)}),
        "priority": _int(-(2**31), 2**31 - 1),
        "timeout": _nullable(_number(0, 86400, exclusive_low=True)),
        "ttft_slo_ms": _nullable(_number(0, 86_400_000, exclusive_low=True)),
        **{f"guided_{key}": _nullable(schema) for key, schema in _CONSTRAINTS.items() if key != "json_object"},
        "guided_decoding_backend": _nullable({"enum": list(BACKENDS)}),
    }


# structured outputs (frontend/structured/request.py): each constraint's shape, as structured_outputs' keys
_PATTERN = {"type": "string", "minLength": 1}
_CONSTRAINTS: dict[str, dict] = {
    "json": {"anyOf": [{"type": "string"}, {"type": "object"}, {"const": True}]},
    "regex": _PATTERN, "grammar": _PATTERN,
    "choice": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_CHOICES},
    "json_object": {"const": True},
}


def _structured(components: dict) -> None:
    components["JsonSchemaFormat"]["properties"]["name"] = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
    fields = components["StructuredOutputsFields"]
    fields["properties"].update({key: _nullable(schema) for key, schema in _CONSTRAINTS.items()},
                                **dict.fromkeys(REFUSED_KEYS, NULL))  # refused but for null


def constrain(components: dict, model_name: str, vocab_size: int, any_model: bool = False,
              logprobs_cap: int = MAX_LOGPROBS) -> None:
    """Narrow the msgspec-made component schemas in place (only where the code refuses what the type allows).
    `logprobs_cap`: common.sampling.logprobs_limit of the server's --max-logprobs and the vocabulary."""
    token = _int(0, vocab_size - 1)
    ids = {"type": "array", "items": token, "minItems": 1}
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    sampling = _sampling(model_name, vocab_size, any_model)
    # prompt_logprobs -1 is the whole vocabulary: taken only where the cap reaches it
    sampling["prompt_logprobs"] = _nullable(_int(-1 if logprobs_cap == vocab_size else 0, logprobs_cap))
    _structured(components)
    completion = components["CompletionRequest"]
    completion["properties"].update(sampling, **{
        "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                                  "maxItems": MAX_PROMPTS},
                             ids, {"type": "array", "items": ids, "minItems": 1, "maxItems": MAX_PROMPTS}]},
        "logprobs": _nullable(_int(0, logprobs_cap)), "suffix": _nullable({"const": ""})})
    completion["required"] = ["prompt"]
    chat = components["ChatCompletionRequest"]
    chat["properties"].update(sampling, **{
        "messages": {"type": "array", "items": {"$ref": "#/components/schemas/ChatMessage"}, "minItems": 1},
        "max_completion_tokens": _nullable(_int(1)), "top_logprobs": _nullable(_int(0, logprobs_cap)),
        "chat_template_kwargs": _nullable({"type": "object",
                                           "propertyNames": {"not": {"enum": sorted(RESERVED_KWARGS)}}})})
    message = components["ChatMessage"]
    message["properties"].update({"role": {"type": "string", "minLength": 1, "examples": list(ROLES)},
                                  "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part},
                                                        NULL]}})
    message["required"] = ["role"]
    message["anyOf"] = [  # content, but beside an assistant's tool calls
        {"required": ["content"], "properties": {"content": {"not": NULL}}},
        {"required": ["tool_calls"], "properties": {"role": {"const": "assistant"},
                                                    "tool_calls": {"type": "array", "minItems": 1}}}]
    message["allOf"] = [_given("tool_calls", {"properties": {"role": {"const": "assistant"}}})]
    tokenize = components["TokenizeRequest"]
    tokenize["properties"]["model"] = _model(model_name, any_model)
    messages = {"type": "array", "items": {"$ref": "#/components/schemas/ChatMessage"}, "minItems": 1}
    tokenize["oneOf"] = [  # exactly one of prompt or messages
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": NULL}},
        {"required": ["messages"], "properties": {"messages": messages, "prompt": NULL}}]
    detokenize = components["DetokenizeRequest"]
    detokenize["properties"].update({"tokens": {"type": "array", "items": token},
                                     "model": _model(model_name, any_model)})
    streamed = _given("stream_options", {"properties": {"stream": {"const": True}}, "required": ["stream"]})
    continued = _given("continue_final_message", {"properties": {"add_generation_prompt": {"const": False}},
                                                  "required": ["add_generation_prompt"]}, value={"const": True})
    completion["allOf"] = [streamed]
    chat["allOf"] = [streamed, continued, _given("top_logprobs", {"properties": {"logprobs": {"const": True}},
                                                                  "required": ["logprobs"]})]
    tokenize["allOf"] = [continued]
    for request in (completion, chat, tokenize, detokenize):
        # a field not declared is refused (decoding.refuse_undeclared), but for a refused field's one accepted value
        request["properties"].update({name: {"const": refused.accepted} for name, refused in REFUSED_FIELDS.items()
                                      if refused.accepted is not None and name not in request["properties"]})
        request["additionalProperties"] = False
        for name, schema in request["properties"].items():  # an explicit null is the default (convert_body)
            if name not in request.get("required", ()) and not _allows_null(schema):
                request["properties"][name] = _nullable(schema)


def _given(name: str, then: dict, value: dict | None = None) -> dict:
    """When field `name` is given (not null, or equal to `value`), the body must also match `then`."""
    return {"if": {"properties": {name: value or {"not": NULL}}, "required": [name]}, "then": then}


def _allows_null(schema: dict) -> bool:
    return schema.get("type") == "null" or NULL in schema.get("anyOf", ())
