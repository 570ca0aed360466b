"""vLLM's LoRARequest for the offline API: which adapter a prompt runs through (`LLM(model, enable_lora=True)`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter to generate through, as vLLM's `vllm.lora.request.LoRARequest`.

    Attributes:
        lora_name: the adapter's name (its prefix-cache blocks are its own, by name and directory).
        lora_int_id: vLLM's id, at least 1; shuttle names adapters by name and directory and keeps it only for
            compatibility.
        lora_path: the adapter's directory (adapter_config.json, adapter_model.safetensors).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
