"""POST /v1/completions as a serving-core call (frontend/serving.py): prompts as text or token ids, echo, suffix
refused, text logprobs with offsets and vLLM's prompt_logprobs on each choice."""

from __future__ import annotations

import time

from shuttle.common.errors import InvalidRequestError
from shuttle.common.sampling import logprobs_limit
from shuttle.frontend.choices import CollectedChoice
from shuttle.frontend.completions.prompt_logprobs import first_k, prompt_logprobs_list, prompt_logprobs_of
from shuttle.frontend.completions.shapes import completion_logprobs, prompt_logprobs_object
from shuttle.frontend.generation import TextDelta, TextGeneration
from shuttle.frontend.request.params import check_logprobs, completion_prompts
from shuttle.frontend.request.protocol import CompletionRequest
from shuttle.frontend.serving import Call, build_generations, check_model, new_request_id, response_model
from shuttle.frontend.state import FrontendState


class CompletionCall(Call):
    """POST /v1/completions (and a WebSocket generate): text choices, `echo`, `logprobs` as in OpenAI's legacy API.

    Args:
        background: batch work (see build_generations).
        one_prompt: when set, a body with several prompts is refused with this message.

    Raises:
        InvalidRequestError, ModelNotFoundError: the body is not valid (param names the field).
    """

    body: CompletionRequest

    def __init__(self, state: FrontendState, body: CompletionRequest, id_prefix: str = "cmpl",
                 background: bool = False, one_prompt: str | None = None):
        check_model(state, body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequestError("best_of is not supported (leave it out or equal to n)", param="best_of")
        if body.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        limit = logprobs_limit(state.config.model.max_logprobs, state.tokenizer.vocab_size)
        self.logprobs = check_logprobs(body.logprobs, "logprobs", limit)
        asked = prompt_logprobs_of(body.prompt_logprobs, body.stream, limit, state.tokenizer.vocab_size)
        # echo with logprobs also scores the prompt (how lm-eval-harness computes loglikelihoods), as vLLM: with
        # the k of prompt_logprobs when both are given; a stream shows prompt logprobs only in its echo
        echoed = self.logprobs if body.echo and self.logprobs is not None else None
        self.prompt_logprobs = asked if asked is not None and (echoed is not None or not body.stream) else echoed
        self.prompts = completion_prompts(body.prompt, state.tokenizer, state.config.model.max_model_len,
                                          body.add_special_tokens)
        if one_prompt is not None and len(self.prompts) != 1:
            raise InvalidRequestError(one_prompt, param="prompt")
        request_id = new_request_id(id_prefix)
        super().__init__(state, body, request_id, {"id": request_id, "object": "text_completion",
                                                   "created": int(time.time()),
                                                   "model": response_model(state, body.model)})
        self.background = background
        self.echo_texts: dict[int, str] = {}  # choice index -> the prompt as given, to prepend (echo)
        self.echo_ids: set[int] = set()  # choices whose prompt was token ids: their echo keeps special tokens
        self.emitted: dict[int, int] = {}  # choice index -> characters of its text sent so far (stream chunks)

    def build(self) -> list[TextGeneration]:
        body, state = self.body, self.state
        generations = build_generations(state, body, self.prompts, self.request_id, body.max_tokens, self.logprobs,
                                        prompt_logprobs=self.prompt_logprobs,
                                        background=self.background, structured=self.structured_output(),
                                        constraint_param=self.constraint_param)
        if body.echo:
            several = isinstance(body.prompt, list) and not isinstance(body.prompt[0], int)
            originals = body.prompt if several else [body.prompt]
            for g in generations:
                original = originals[g.index // body.n]
                if isinstance(original, str):
                    self.echo_texts[g.index] = original
                else:  # vLLM echoes decode(ids), special tokens and all
                    self.echo_texts[g.index] = state.tokenizer.decode(g.prompt_token_ids, skip_special_tokens=False)
                    self.echo_ids.add(g.index)
        return generations

    def final_choice(self, choice: CollectedChoice) -> dict:
        g = choice.generation
        out = self._choice(g, choice.text, choice.token_ids, choice.logprobs, choice.text_starts, g.finish_reason,
                           True)
        if self.prompt_logprobs is not None:  # vLLM's, on each choice of a whole response
            out["prompt_logprobs"] = prompt_logprobs_list(self.state.tokenizer, g.prompt_token_ids, g.prompt_logprobs,
                                                          self.as_token_ids)
        return out

    def chunk_choices(self, delta: TextDelta, first: bool) -> list[dict]:
        return [self._choice(self.generations[delta.index], delta.text, delta.token_ids, delta.logprobs,
                             delta.text_starts, delta.finish_reason, first)]

    def _choice(self, g: TextGeneration, text: str, token_ids: list[int], lps, text_starts: list[int],
                finish: str | None, first: bool) -> dict:
        tokenizer = self.state.tokenizer
        echo_length = len(self.echo_texts.get(g.index, ""))
        prefix = self.echo_texts.get(g.index, "") if first else ""
        start = self.emitted.get(g.index, 0) + len(prefix)
        self.emitted[g.index] = start + len(text)
        lp_object = None
        if self.logprobs is not None:
            as_ids = self.as_token_ids
            lp_object = completion_logprobs(tokenizer, token_ids, lps, text_starts, echo_length, start + len(text),
                                            as_ids)
            if first and g.index in self.echo_texts:
                echoed = [first_k(lp, self.logprobs) for lp in g.prompt_logprobs]
                lp_object = prompt_logprobs_object(tokenizer, g.prompt_token_ids, echoed, lp_object, len(prefix),
                                                   g.index in self.echo_ids, as_ids)
        out = {"index": g.index, "text": prefix + text, "logprobs": lp_object, "finish_reason": finish}
        if self.body.return_token_ids:
            out["token_ids"] = token_ids
            if first:
                out["prompt_token_ids"] = g.prompt_token_ids
        return out
