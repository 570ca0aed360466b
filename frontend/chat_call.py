"""POST /v1/chat/completions as a serving-core call (frontend/serving.py): the chat template, tool calls, the
thinking of a reasoning model split from its answer, and message-shaped choices and deltas."""

from __future__ import annotations

import time

import msgspec

from shuttle.common.errors import InvalidRequestError
from shuttle.common.sampling import StructuredOutput, logprobs_limit
from shuttle.frontend.choices import CollectedChoice
from shuttle.frontend.completions.prompt_logprobs import prompt_logprobs_list, prompt_logprobs_of
from shuttle.frontend.completions.shapes import chat_logprobs
from shuttle.frontend.generation import TextDelta, TextGeneration
from shuttle.frontend.reasoning.choices import ReasoningChoices, reasoning_fields
from shuttle.frontend.request.params import check_logprobs
from shuttle.frontend.request.protocol import ChatCompletionRequest, TokenizeRequest
from shuttle.frontend.serving import Call, build_generations, check_model, new_request_id, response_model
from shuttle.frontend.state import FrontendState
from shuttle.frontend.tools.calls import ToolCallChoices, tool_parser_of
from shuttle.frontend.tools.request import template_tools, tool_constraint, tool_use_of


def chat_prompt_ids(state: FrontendState, body: ChatCompletionRequest | TokenizeRequest,
                    add_special_tokens: bool, any_length: bool = False) -> list[int]:
    """Token ids of a chat request's prompt: the messages (and tools) through the chat template with the request's
    options. Special-token text in message content stays text unless parse_special_tokens_in_content.
    `any_length`: a prompt far over the context is tokenized all the same (a count of it, not a generation).

    Raises:
        InvalidRequestError: the template refused the messages or options, or the prompt is empty or too long.
    """
    tokenizer = state.tokenizer
    assert body.messages is not None  # a TokenizeRequest comes here only with messages
    text = state.chat_template.render(
        body.messages, body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
        escape=None if body.parse_special_tokens_in_content else tokenizer.special_text.escape,
        tools=template_tools(body.tools or ()))
    ids = tokenizer.encode_chat(text, add_special_tokens, None if any_length else state.config.model.max_model_len)
    if not ids:
        raise InvalidRequestError("the rendered chat prompt is empty", param="messages")
    return ids


class ChatCall(Call):
    """POST /v1/chat/completions: message choices; in a stream each choice opens with a role-only delta (as OpenAI's
    streams do). With tools, each choice's text is parsed into content and tool calls (frontend/tools/calls.py), and
    tool_choice "required" or a named function constrains the output to them (frontend/tools/request.py). Under
    --reasoning-parser the thinking is split from the answer first (frontend/reasoning/): calls and a grammar apply
    to the answer only.

    Raises:
        InvalidRequestError, ModelNotFoundError: the body is not valid (param names the field).
    """

    body: ChatCompletionRequest
    response_object = {"object": "chat.completion"}
    chunk_object = {"object": "chat.completion.chunk"}

    def __init__(self, state: FrontendState, body: ChatCompletionRequest, id_prefix: str = "chatcmpl",
                 background: bool = False):
        check_model(state, body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        limit = logprobs_limit(state.config.model.max_logprobs, state.tokenizer.vocab_size)
        self.logprobs = check_logprobs(body.top_logprobs or 0, "top_logprobs", limit) if body.logprobs else None
        asked = prompt_logprobs_of(body.prompt_logprobs, body.stream, limit, state.tokenizer.vocab_size)
        self.prompt_logprobs = None if body.stream else asked  # a stream's chunks never carry them (vLLM)
        tool_config = state.config.tool_calls
        self.tool_use = tool_use_of(body.tools, body.tool_choice, body.parallel_tool_calls,
                                    tool_config.enable_auto_tool_choice and tool_config.tool_call_parser is not None)
        parser = tool_parser_of(self.tool_use, tool_config.tool_call_parser)
        self.tool_calls = ToolCallChoices(parser, self.tool_use.parallel) if parser is not None else None
        self.prompt = chat_prompt_ids(state, body, body.add_special_tokens)
        # a reasoning model's thinking, split from each choice's content (frontend/reasoning/)
        self.reasoning = ReasoningChoices(state.reasoning, state.reasoning.thinks(
            self.prompt, body.chat_template_kwargs)) if state.reasoning is not None else None
        self._output_ids: dict[int, list[int]] = {}  # choice index -> its token ids so far (reasoning_tokens)
        if self.reasoning is not None and not body.include_reasoning:
            self.logprobs = None  # they would show the thinking's tokens (vLLM leaves them out too)
        request_id = new_request_id(id_prefix)
        super().__init__(state, body, request_id, {"id": request_id, "created": int(time.time()),
                                                   "model": response_model(state, body.model)})
        self.background = background
        # vLLM's return_token_ids for chat: the prompt's ids once per response (on the first chunk when streaming)
        if body.return_token_ids:
            self.first_fields = {"prompt_token_ids": self.prompt}

    def build(self) -> list[TextGeneration]:
        body = self.body
        newer = body.max_completion_tokens is not None
        return build_generations(self.state, body, [self.prompt], self.request_id,
                                 body.max_completion_tokens if newer else body.max_tokens, self.logprobs,
                                 prompt_param="messages", prompt_logprobs=self.prompt_logprobs,
                                 background=self.background,
                                 max_tokens_param="max_completion_tokens" if newer else "max_tokens",
                                 structured=self.structured_output(), constraint_param=self.constraint_param)

    def structured_output(self) -> StructuredOutput | None:
        """The constraint that tool_choice "required" or a named function makes, else the body's own.

        A forced call beside response_format or structured_outputs is served as the call, as OpenAI and vLLM do (the
        Agents SDK sends an agent's output type with every turn, tool_choice "required" included): the format is
        for a text answer, and a forced call's output is never one. The body's own constraint is still checked.

        Raises:
            InvalidRequestError: as Call.structured_output.
        """
        own = super().structured_output()
        forced = tool_constraint(self.tool_use)
        if forced is not None:
            self.constraint_param = "tools"
        found = forced or own
        after = self.reasoning.grammar_starts_after if self.reasoning is not None else None
        if found is not None and after is not None:  # the thinking is free; the grammar governs the answer (vLLM)
            found = msgspec.structs.replace(found, starts_after=after)
        return found

    def split_reasoning(self, text: str) -> tuple[dict, str | None]:
        """A whole choice's thinking as message fields (none without a reasoning parser; null under
        include_reasoning false) and the text left for content and tool calls (None: the thinking never ended)."""
        if self.reasoning is None:
            return {}, text
        thought, content = self.reasoning.split(text)
        # an empty thinking ("<think></think>") is none, as a stream shows it (no reasoning delta is ever sent)
        return reasoning_fields((thought or None) if self.body.include_reasoning else None), content

    def answering(self, index: int) -> bool:
        """Whether streamed choice `index` is past its thinking (always, without a reasoning parser): before, no
        tool call can have begun."""
        return self.reasoning is None or self.reasoning.answering(index)

    def cut(self, delta: TextDelta) -> bool:
        """Whether `delta` is its choice's last and a stop the request set ended it (Generation.stopped_by_request)."""
        return delta.finish_reason is not None and self.generations[delta.index].stopped_by_request

    def reasoning_delta(self, delta: TextDelta) -> tuple[str, str]:
        """(thinking, answer) text that a streamed delta releases; the thinking "" under include_reasoning false."""
        if self.reasoning is None:
            return "", delta.text
        piece = self.reasoning.delta(delta.index, delta.text, delta.finish_reason is not None)
        return piece.reasoning if self.body.include_reasoning else "", piece.content

    def usage(self) -> dict:
        """As Call.usage; under --reasoning-parser with vLLM's completion_tokens_details.reasoning_tokens (the
        thinking's tokens, every choice's, so far)."""
        out = super().usage()
        if self.reasoning is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": sum(
                self.reasoning.count_tokens(ids) for ids in self._output_ids.values())}
        return out

    async def collect(self) -> dict:
        """As Call.collect, with vLLM's `prompt_logprobs` of the (one) prompt beside the choices when asked."""
        body = await super().collect()
        if self.prompt_logprobs is not None:
            g = self.generations[0]
            body["prompt_logprobs"] = prompt_logprobs_list(self.state.tokenizer, g.prompt_token_ids,
                                                           g.prompt_logprobs, self.as_token_ids)
        return body

    def final_choice(self, choice: CollectedChoice) -> dict:
        g = choice.generation
        thought, text = self.split_reasoning(choice.text)  # tool calls are read from the answer only
        self._output_ids[g.index] = choice.token_ids
        message, finish = {"role": "assistant", "content": text}, g.finish_reason
        if self.tool_calls is not None and text is not None:  # None: cut while thinking, no call begun
            message, finish = self.tool_calls.message(text, finish, g.stopped_by_request)
        message.update(thought)
        return self._choice("message", g.index, message, choice.token_ids, choice.logprobs, finish)

    def chunk_choices(self, delta: TextDelta, first: bool) -> list[dict]:
        thought, text = self.reasoning_delta(delta)
        self._output_ids.setdefault(delta.index, []).extend(delta.token_ids)
        message, finish = {"content": text} if text else {}, delta.finish_reason
        if self.tool_calls is not None and self.answering(delta.index):
            message, finish = self.tool_calls.delta(delta.index, text, finish, self.cut(delta))
        if thought:
            message = {**reasoning_fields(thought), **message}
        # a delta that released nothing (a think tag, text held as a possible tag) and carries nothing else is not
        # sent, as vLLM skips it
        silent = self.reasoning is not None and not message and finish is None and self.logprobs is None and \
            not self.body.return_token_ids
        choices = [] if silent else [self._choice("delta", delta.index, message, delta.token_ids, delta.logprobs,
                                                  finish)]
        if not first:
            return choices
        role = {"index": delta.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
        return [role, *choices]

    def _choice(self, key: str, index: int, message: dict, token_ids: list[int], lps, finish: str | None) -> dict:
        out = {"index": index, key: message,
               "logprobs": None if self.logprobs is None else chat_logprobs(self.state.tokenizer, token_ids, lps,
                                                                            self.as_token_ids),
               "finish_reason": finish}
        if self.body.return_token_ids:
            out["token_ids"] = token_ids
        return out
