"""The HTTP API's configuration sections: tool calling (ToolCallConfig) and the API's options (ApiConfig), under
vLLM's flag names. Each field is declared here once; common/config.py lists both among `shuttle serve`'s sections."""

from __future__ import annotations

from dataclasses import dataclass

from shuttle.common.arg_types import LOG_LEVELS, count, option, path_prefix, seconds

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # --tool-call-parser's names (vLLM's; frontend/tools/parsers)


@dataclass(frozen=True)
class ToolCallConfig:
    """Tool calling on /v1/chat/completions (frontend/tools/request.py), under vLLM's flag names. Each field's help
    says what it means."""

    enable_auto_tool_choice: bool = option(False, "take tool_choice \"auto\" (the default of a request that lists "
                                                  "tools): the model decides whether to call a tool, and its output "
                                                  "is parsed with --tool-call-parser")
    tool_call_parser: str | None = option(None, "the format the model writes tool calls in, parsed out of its output "
                                                "under tool_choice auto: " + ", ".join(TOOL_CALL_PARSERS),
                                          metavar="{" + ",".join(TOOL_CALL_PARSERS) + "}")


def tool_call_error(tools: ToolCallConfig) -> str | None:
    """Why the tool flags cannot be served (None when they can): an unknown parser, or auto without one."""
    if tools.tool_call_parser is not None and tools.tool_call_parser not in TOOL_CALL_PARSERS:
        return (f"--tool-call-parser {tools.tool_call_parser!r} is not a tool-call parser; choose one of "
                f"{', '.join(TOOL_CALL_PARSERS)}")
    if tools.enable_auto_tool_choice and tools.tool_call_parser is None:
        return "--enable-auto-tool-choice needs --tool-call-parser (the format the model writes tool calls in)"
    return None


REASONING_PARSERS = ("deepseek_r1", "qwen3")  # --reasoning-parser's names (vLLM's; frontend/reasoning)
METRIC_PREFIXES = ("shuttle", "vllm")  # --metric-prefix: the same series under shuttle's or vLLM's prefix


@dataclass(frozen=True)
class ApiConfig:
    """The HTTP API's options, under vLLM's flag names where vLLM has them (docs/vllm-flags.md). Each field's help
    says what it means."""

    uds: str | None = option(None, "serve HTTP on this Unix domain socket instead of --host/--port", metavar="PATH")
    root_path: str = option("", "path prefix a reverse proxy adds in front of every route (e.g. /llm): each route "
                                "answers both with and without it", metavar="PREFIX", type=path_prefix)
    enable_server_load_tracking: bool = option(False, "count the requests being served and report them on GET /load")
    enable_tokenizer_info_endpoint: bool = option(False, "serve GET /tokenizer_info (the tokenizer's configuration "
                                                         "and chat template)")
    enable_request_id_headers: bool = option(False, "answer every response with an X-Request-Id header (the "
                                                    "client's own, or the response's id): shuttle always does")
    return_tokens_as_token_ids: bool = option(False, "logprobs name each token as token_id:ID instead of its text "
                                                     "(a token that is not whole UTF-8 can then be told apart)")
    enable_force_include_usage: bool = option(False, "every response carries usage, a stream too (the usage so far "
                                                     "on every chunk and a last usage chunk, as vLLM), whatever "
                                                     "the request's stream_options say")
    enable_prompt_tokens_details: bool = option(True, "usage reports prompt_tokens_details.cached_tokens (the prompt "
                                                      "tokens found in the prefix cache)")
    disable_fastapi_docs: bool = option(False, "serve neither /openapi.json nor the API docs pages (vLLM's name; "
                                               "shuttle's HTTP server is aiohttp)")
    uvicorn_log_level: str = option("info", "level of the HTTP access log, one line per request (vLLM's name; "
                                            "shuttle's HTTP server is aiohttp, its logger aiohttp.access)",
                                    choices=["trace", *LOG_LEVELS], type=str.lower)
    reasoning_parser: str | None = option(None, "the format a reasoning model writes its thinking in, split out of "
                                                "its output as reasoning_content: " + ", ".join(REASONING_PARSERS),
                                          choices=list(REASONING_PARSERS))
    metric_prefix: str = option("shuttle", "prefix of every /metrics series: shuttle, or vllm for vLLM's dashboards, "
                                           "alerts and autoscalers", choices=list(METRIC_PREFIXES))
    responses_store_max_entries: int = option(1024, "most responses of /v1/responses kept for previous_response_id "
                                                    "and GET (the oldest go first; 0: none kept)", type=count)
    responses_store_max_age: float = option(3600.0, "seconds a stored response is kept after it ended (0: no age "
                                                    "limit)", type=seconds)
