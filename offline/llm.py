"""vLLM's offline `LLM`: batch generation in the caller's process, with no server and no sockets.

The scheduler and the model runner are the ones `shuttle serve` runs in its scheduler and worker processes, turned by
scheduler/in_process.py's drive; each sequence's outputs are detokenized and cut at stop strings by the frontend's
TextGeneration, so a prompt gets here what the server would answer it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, cast

import msgspec

from shuttle.common.errors import GenerationError, InvalidRequestError, ModelDirError
from shuttle.common.lora import LoRAModule, check_adapter_for
from shuttle.common.messages import RequestOutput as EngineOutput
from shuttle.common.messages import Submit, TokenLogprobs
from shuttle.frontend.engine.api import Engine
from shuttle.frontend.generation import TextGeneration
from shuttle.frontend.request.chat_template import ChatTemplate
from shuttle.frontend.request.protocol import ChatMessage
from shuttle.frontend.tokenizer import TextTokenizer
from shuttle.offline.engine_args import engine_config
from shuttle.offline.lora_request import LoRARequest
from shuttle.offline.outputs import CompletionOutput, RequestOutput, TextPrompt, TokensPrompt, position_logprobs
from shuttle.offline.sampling_params import SamplingParams
from shuttle.scheduler.in_process import drive
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.lora_slots import lora_slots_for
from shuttle.scheduler.scheduler import Scheduler

CLIENT = b"offline"  # the scheduler's name for this process's requests (a server's are its frontends')

PromptInput = str | TextPrompt | TokensPrompt


@dataclass
class _Sequence:
    """One output sequence being generated: its TextGeneration and what it has released so far."""

    generation: TextGeneration
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class _Prompt:
    """One prompt of a generate call: its text (None when given as ids), ids, sampling and sequences."""

    request_id: str
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence] = field(default_factory=list)
    unfinished: int = 0


class _DrivenHere:
    """The engine as an offline TextGeneration sees it: never asked for outputs (LLM._run hands each to advance()),
    and with no estimate of when to retry a refusal (a server's queue-drain estimate)."""

    def refusal_retry_after(self) -> float | None:
        return None


def _value_error(exc: InvalidRequestError) -> ValueError:
    return ValueError(str(exc))


class LLM:
    """A model served in this process (vLLM's LLM): `LLM(model, **engine_args)`, then generate() or chat().

    Args:
        model: a model directory or a Hugging Face id, as `shuttle serve MODEL` takes it.
        engine_args: `shuttle serve`'s options by field name (max_model_len=512, max_num_seqs=64, dtype="float32",
            seed=0, enable_prefix_caching=False, num_kv_blocks=..., device="cpu", ...), as Python values.
    Raises:
        TypeError: a keyword that is no option of `shuttle serve`.
        ValueError: an option the offline engine cannot honour (tensor_parallel_size > 1, the server's own), or a
            value `shuttle serve` refuses.
        ModelDirError: the model cannot be found or read.
        DeviceError, UnsupportedModelError, KVSizingError: as `shuttle serve` refuses them at start-up.
    """

    def __init__(self, model: str, **engine_args: Any):
        from shuttle.worker.parallel import join_group, local_device
        from shuttle.worker.worker import ModelRunner

        self.config = config = engine_config(model, engine_args)
        source = config.model.tokenizer_dir or config.model.model_dir
        self.tokenizer = TextTokenizer(source)
        self._source = source
        self._chat_template = ChatTemplate(source, config.chat_template)
        device = local_device(config.worker.device, 0, 0, 1)
        parallel = join_group(config.parallel, 0, config.model.model_dir, config.model.hf_config(), device)
        self._runner = ModelRunner(config, device, parallel=parallel)
        self._scheduler = self._new_scheduler()
        self._next_id = 0
        self._checked_adapters: set[str] = set()  # adapter directories lora_request has checked

    def _new_scheduler(self) -> Scheduler:
        """A scheduler over an empty block pool, its worker's per-request state dropped with the old one's."""
        for request_id in list(self._runner.batch.requests):
            self._runner.batch.drop(request_id)
        cache, model = self.config.cache, self.config.model
        kv = KVCacheManager(self._runner.kv_cache.num_blocks, cache.block_size, cache.enable_prefix_caching)
        return Scheduler(self.config.scheduler, kv, model.max_model_len, model.eos_token_ids,
                         lora=lora_slots_for(self.config.lora))

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() sample with when given none: the model's generation_config.json defaults
        (--generation-config) over SamplingParams' own."""
        return SamplingParams.from_defaults(self.config.model.sampling_defaults)

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True,
                 lora_request: LoRARequest | Sequence[LoRARequest] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in input order, when all have finished.

        Args:
            prompts: a string, a TextPrompt ({"prompt": text}), a TokensPrompt ({"prompt_token_ids": [ids]}), or a
                list of them.
            sampling_params: one for every prompt, or a list with one per prompt (None: get_default_sampling_params).
            use_tqdm: show a progress bar of finished prompts (or a tqdm-like class to make it with).
            lora_request: the LoRA adapter every prompt runs through, or a list with one per prompt (None entries:
                the base model); needs enable_lora=True.
        Raises:
            ValueError: a malformed or empty prompt, ids outside the vocabulary, a prompt that leaves no room for
                output in max_model_len, sampling parameters out of range; a request the engine refused (its
                message). Nothing is generated when a prompt or its parameters are refused.
            TypeError: a prompt of another type.
        """
        inputs = self._inputs(prompts)
        return self._run(inputs, self._params_list(sampling_params, len(inputs)), use_tqdm,
                         self._adapters(lora_request, len(inputs)))

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None, lora_request: Any = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of OpenAI-style messages) or to each of several, through the
        model's chat template (or `chat_template`: a file or the template itself, as --chat-template takes it).

        Message content that spells a special token stays text, as `shuttle serve` renders it.

        Args:
            add_generation_prompt, continue_final_message, chat_template_kwargs: as the server's chat request fields.
            lora_request: as generate() takes it. tools: refused unless None (offline tool calling is not
                implemented).
        Raises:
            ValueError: a malformed message, no chat template, a template that refused the messages, and what
                generate() raises.
        """
        if tools is not None:
            raise ValueError("tools: shuttle does not implement it in the offline LLM")
        template = self._chat_template if chat_template is None else ChatTemplate(self._source, chat_template)
        conversations = [messages] if not messages or isinstance(messages[0], dict) else messages
        inputs: list[tuple[str | None, list[int]]] = []
        for conversation in conversations:
            try:
                parsed = msgspec.convert(conversation, list[ChatMessage])
            except msgspec.ValidationError as exc:
                raise ValueError(f"messages: {exc}") from None
            try:
                text = template.render(parsed, add_generation_prompt, continue_final_message, chat_template_kwargs,
                                       escape=self.tokenizer.special_text.escape)
                ids = self.tokenizer.encode_chat(text, False, self.config.model.max_model_len)
            except InvalidRequestError as exc:
                raise _value_error(exc) from None
            inputs.append((text, self._checked(ids)))
        return self._run(inputs, self._params_list(sampling_params, len(inputs)), use_tqdm,
                         self._adapters(lora_request, len(inputs)))

    def _inputs(self, prompts: PromptInput | Sequence[PromptInput]) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) of each prompt, every one checked."""
        items = [prompts] if isinstance(prompts, (str, dict)) else prompts
        if not isinstance(items, (list, tuple)):
            raise TypeError(f"prompts must be a string, a TextPrompt, a TokensPrompt or a list of them, not "
                            f"{type(prompts).__name__}")
        inputs: list[tuple[str | None, list[int]]] = []
        for prompt in items:
            if isinstance(prompt, str):
                inputs.append((prompt, self._checked(self._encode(prompt))))
            elif isinstance(prompt, dict):
                others = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
                if others:
                    raise ValueError(f"{', '.join(others)}: shuttle does not implement it (a prompt is text or "
                                     f"token ids)")
                if "prompt_token_ids" in prompt:
                    ids = list(cast(TokensPrompt, prompt)["prompt_token_ids"])
                    inputs.append((prompt.get("prompt"), self._checked(ids)))
                elif "prompt" in prompt:
                    text = cast(TextPrompt, prompt)["prompt"]
                    inputs.append((text, self._checked(self._encode(text))))
                else:
                    raise ValueError("a prompt dict needs prompt (text) or prompt_token_ids")
            else:
                raise TypeError(f"a prompt must be a string, a TextPrompt or a TokensPrompt ({{'prompt_token_ids': "
                                f"[...]}}), not {type(prompt).__name__}")
        return inputs

    def _encode(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text, True, self.config.model.max_model_len)
        except InvalidRequestError as exc:
            raise _value_error(exc) from None

    def _checked(self, ids: list[int]) -> list[int]:
        """`ids` when the model can continue them (vLLM refuses the same prompts, with ValueError).

        Raises:
            ValueError: empty, an id outside the vocabulary, or no room for one output token in max_model_len.
        """
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        max_len = self.config.model.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"the prompt (length {len(ids)}) plus at least one output token is longer than the "
                             f"maximum model length of {max_len}: shorten it or raise max_model_len")
        return ids

    def _params_list(self, sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                     count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if isinstance(sampling_params, (str, bytes, dict)) or not isinstance(sampling_params, Sequence):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, not "
                            f"{type(sampling_params).__name__}")
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"{len(params)} sampling_params for {count} prompts: give one, or one per prompt")
        wrong = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if wrong is not None:
            raise TypeError(f"sampling_params must be SamplingParams, not {type(wrong).__name__}")
        return params

    def _adapters(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                  count: int) -> list[LoRAModule | None]:
        """Each prompt's adapter (None: the base model), every one checked as a runtime load is.

        Raises:
            ValueError: adapters without enable_lora, a list of another length, an adapter that cannot be served.
        """
        if lora_request is None:
            return [None] * count
        if not isinstance(lora_request, (LoRARequest, Sequence)) or isinstance(lora_request, (str, bytes)):
            raise TypeError(f"lora_request must be a LoRARequest or a list of them, not "
                            f"{type(lora_request).__name__}")
        requests = [lora_request] * count if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(requests) != count:
            raise ValueError(f"{len(requests)} lora_request for {count} prompts: give one, or one per prompt")
        wrong = next((r for r in requests if r is not None and not isinstance(r, LoRARequest)), None)
        if wrong is not None:
            raise TypeError(f"lora_request must be LoRARequest or None, not {type(wrong).__name__}")
        lora = self.config.lora
        adapters: list[LoRAModule | None] = []
        for request in requests:
            if request is None:
                adapters.append(None)
                continue
            if not lora.enable_lora:
                raise ValueError("lora_request needs LLM(..., enable_lora=True)")
            path = str(Path(request.lora_path).absolute())
            if path not in self._checked_adapters:
                try:
                    check_adapter_for(self.config.model.model_dir, path, lora.max_lora_rank)
                except ModelDirError as exc:
                    raise ValueError(str(exc)) from None
                self._checked_adapters.add(path)
            adapters.append(LoRAModule(name=request.lora_name, path=path))
        return adapters

    def _run(self, inputs: list[tuple[str | None, list[int]]], params: list[SamplingParams],
             use_tqdm: bool | Callable[..., Any], adapters: list[LoRAModule | None]) -> list[RequestOutput]:
        """Run every prompt to its end (all refused, with nothing run, when one's parameters are out of range)."""
        prompts = self._prompts(inputs, params, adapters)
        pending = deque(s for p in prompts for s in p.sequences)
        live: dict[str, tuple[_Prompt, _Sequence]] = {}
        owner = {id(s): p for p in prompts for s in p.sequences}
        failures: list[GenerationError] = []
        bar = self._progress(use_tqdm, len(prompts))
        queue_bound = self.config.scheduler.max_waiting_requests
        scheduler = self._scheduler

        def submit_more() -> None:  # no more waiting than the queue takes, as a server's clients would
            while pending and scheduler.num_waiting < queue_bound and not failures:
                sequence = pending.popleft()
                sequence.generation.begin()
                live[sequence.generation.request.request_id] = (owner[id(sequence)], sequence)
                scheduler.add_request(CLIENT, sequence.generation.request)

        def on_outputs(outputs: list[EngineOutput]) -> None:
            for output in outputs:
                if output.request_id not in live:
                    continue  # what a step in flight computed for a sequence a stop string ended
                prompt, sequence = live[output.request_id]
                try:
                    delta = sequence.generation.advance(output)
                except GenerationError as exc:
                    failures.append(exc)
                    scheduler.abort(list(live))
                    live.clear()
                    return
                if delta is not None:
                    sequence.texts.append(delta.text)
                    sequence.token_ids += delta.token_ids
                    sequence.logprobs += delta.logprobs
                if sequence.generation.finish_reason is not None:
                    del live[output.request_id]
                    if output.finish_reason is None:  # a stop string ended it: the scheduler has not
                        scheduler.abort([output.request_id])
                    prompt.unfinished -= 1
                    if not prompt.unfinished and bar is not None:
                        bar.update(1)
            submit_more()

        try:
            while (pending or live) and not failures:
                before = (len(pending), len(live))
                submit_more()
                drive(scheduler, self._runner, on_outputs, CLIENT,
                      max_in_flight=2 if self.config.scheduler.async_scheduling else 1)
                on_outputs(scheduler.take_outputs().get(CLIENT, []))  # refusals at arrival, with no step after them
                if (len(pending), len(live)) == before and not scheduler.has_work and not failures:
                    raise RuntimeError(f"the engine stopped with {len(live)} sequences unfinished")
        except BaseException:
            self._scheduler = self._new_scheduler()  # steps in flight were lost with drive's pipeline
            raise
        finally:
            if bar is not None:
                bar.close()
        if failures:
            error = failures[0]
            raise ValueError(str(error)) if error.status == 400 else RuntimeError(f"{error} (status {error.status})")
        return [self._request_output(p) for p in prompts]

    def _prompts(self, inputs: list[tuple[str | None, list[int]]], params: list[SamplingParams],
                 adapters: list[LoRAModule | None]) -> list[_Prompt]:
        """A _Prompt per input with its sequences made (each sampling checked before any is submitted)."""
        model = self.config.model
        prompts = []
        for (text, ids), sampling, adapter in zip(inputs, params, adapters):
            base = sampling.engine_params(len(ids), model.max_model_len, self.tokenizer.vocab_size,
                                          model.max_logprobs)
            request_id = str(self._next_id)
            self._next_id += 1
            prompt = _Prompt(request_id, text, ids, sampling, unfinished=sampling.n)
            for j in range(sampling.n):  # output j of a seeded prompt samples with seed + j, as the server's choices
                engine = base if base.seed is None else msgspec.structs.replace(base, seed=(base.seed + j) % 2**64)
                submit = Submit(request_id=f"{request_id}-{j}", prompt_token_ids=ids, sampling=engine,
                                arrival_time=time.time(), group_id=request_id,
                                lora_name=adapter.name if adapter else "", lora_path=adapter.path if adapter else "")
                generation = TextGeneration(cast(Engine, _DrivenHere()), self.tokenizer, submit, j,
                                            sampling.stop_strings, sampling.include_stop_str_in_output)
                prompt.sequences.append(_Sequence(generation))
            prompts.append(prompt)
        return prompts

    def _progress(self, use_tqdm: bool | Callable[..., Any], total: int) -> Any:
        if not use_tqdm:
            return None
        if callable(use_tqdm):
            return use_tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)

    def _request_output(self, prompt: _Prompt) -> RequestOutput:
        token_text = self._token_text
        outputs = []
        for j, sequence in enumerate(prompt.sequences):
            generation = sequence.generation
            logprobs = None
            if prompt.params.logprobs is not None:
                logprobs = [position_logprobs(t, lp, token_text) for t, lp in zip(sequence.token_ids,
                                                                                  sequence.logprobs)]
            outputs.append(CompletionOutput(
                index=j, text="".join(sequence.texts), token_ids=sequence.token_ids,
                cumulative_logprob=sum(lp.logprob for lp in sequence.logprobs) if logprobs is not None else None,
                logprobs=logprobs, finish_reason=generation.finish_reason,
                stop_reason=self._stop_reason(generation, sequence.token_ids)))
        first = prompt.sequences[0].generation
        prompt_logprobs = None
        if prompt.params.prompt_logprobs is not None:
            prompt_logprobs = [None, *(position_logprobs(t, lp, token_text)
                                       for t, lp in zip(prompt.token_ids[1:], first.prompt_logprobs))]
        return RequestOutput(prompt.request_id, prompt.text, prompt.token_ids, prompt_logprobs, outputs,
                             num_cached_tokens=first.num_cached_tokens)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)[0]

    def _stop_reason(self, generation: TextGeneration, token_ids: list[int]) -> int | str | None:
        """vLLM's stop_reason: the stop string, else the stop token id, that ended the sequence (None: the
        end-of-sequence token, or length)."""
        if generation.finish_reason != "stop":
            return None
        if generation.stop_string is not None:
            return generation.stop_string
        sampling = generation.request.sampling
        last = token_ids[-1] if token_ids else None
        if last is None or (not sampling.ignore_eos and last in self.config.model.eos_token_ids):
            return None
        return last if last in sampling.stop_token_ids else None
