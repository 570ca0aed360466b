"""The offline Python API, as vLLM's: `LLM(model, **engine_args).generate(prompts, SamplingParams(...))` and
`LLM.chat(messages)`, the engine running in the caller's process (docs/offline.md)."""

from shuttle.offline.llm import LLM
from shuttle.offline.lora_request import LoRARequest
from shuttle.offline.outputs import CompletionOutput, Logprob, RequestOutput, TextPrompt, TokensPrompt
from shuttle.offline.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "TextPrompt",
           "TokensPrompt"]
