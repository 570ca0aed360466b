"""`shuttle plan --device NAME MODEL_DIR`: the plan for a device that is not present, from its datasheet.

Nothing runs the model: the weights, the KV bytes per token and the step times come from the model's config.json
and the device's published peaks (capacity/hardware.py). The KV budget is --gpu-memory-utilization (default 0.9)
of the device's memory, less the weights and an activation allowance for the largest step (its tokens' hidden
states, their MLP activations and the sampled rows' logits). The step times are the roofline of scheduler/step_cost.py
at full efficiency: lower bounds, which a calibration on the device (`shuttle calibrate`) turns into predictions.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from shuttle.capacity import hardware
from shuttle.capacity.memory_plan import MiB, concurrency_table
from shuttle.common.capacity import kv_blocks_for_memory, kv_cache_bytes
from shuttle.common.devices import resolve_dtype
from shuttle.common.model_config import ModelConfig
from shuttle.scheduler.step_cost import Roofline, StepShape

DEFAULT_UTILIZATION = 0.9


@dataclass
class DevicePlan:
    """The plan in bytes and seconds; see the module docstring."""

    model_dir: str
    device: hardware.Device
    dtype: str
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    utilization: float
    roofline: Roofline
    tied_embeddings: bool = False
    kv_cache_memory: int | None = None  # --kv-cache-memory: the KV budget in bytes, instead of the utilization's
    fixed_blocks: int | None = None  # --num-kv-blocks: the KV cache's blocks, whatever the budget

    @property
    def weight_bytes(self) -> int:
        r = self.roofline
        embeddings = (1 if self.tied_embeddings else 2) * r.vocab * r.hidden  # the input table and the LM head
        return (r.layers * r.layer_params + embeddings) * r.dtype_bytes

    @property
    def activation_bytes(self) -> int:
        r = self.roofline
        per_token = (4 * r.hidden + 2 * r.intermediate) * r.dtype_bytes
        return self.max_num_batched_tokens * per_token + self.max_num_seqs * r.vocab * 4

    @property
    def kv_budget_bytes(self) -> int:
        if self.fixed_blocks is not None:
            return kv_cache_bytes(self.fixed_blocks, self.block_size, self.roofline.kv_bytes_per_token)
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        return int(self.device.memory_bytes * self.utilization) - self.weight_bytes - self.activation_bytes

    @property
    def kv_budget_source(self) -> str:
        if self.fixed_blocks is not None:
            return "--num-kv-blocks"
        if self.kv_cache_memory is not None:
            return "--kv-cache-memory"
        return f"{self.utilization} x memory, less weights and activations"

    @property
    def num_kv_blocks(self) -> int:
        if self.fixed_blocks is not None:
            return self.fixed_blocks
        return kv_blocks_for_memory(max(self.kv_budget_bytes, 0), self.roofline.kv_bytes_per_token, self.block_size)

    def overcommitted_bytes(self) -> int:
        """Bytes by which weights, activations and an explicit KV budget exceed the device's memory (0: they fit)."""
        return max(0, self.weight_bytes + self.activation_bytes + self.kv_budget_bytes - int(self.device.memory_bytes))

    def step_seconds(self) -> dict[str, float]:
        """Roofline lower bounds of a full decode step (max_num_seqs at half of max_model_len) and of a full
        prefill chunk (max_num_batched_tokens of one prompt, at the start of its context)."""
        seqs, context, chunk = self.max_num_seqs, self.max_model_len // 2, self.max_num_batched_tokens
        decode = StepShape(seqs, 0, seqs, 0, seqs * context, seqs)
        prefill = StepShape(chunk, 1, 0, chunk * chunk, 0, 1)
        return {f"decode step ({seqs} sequences at context {context})": sum(self.roofline.seconds(decode)),
                f"prefill step ({chunk} tokens of one prompt)": sum(self.roofline.seconds(prefill))}

    def to_json(self) -> dict:
        return {"model_dir": self.model_dir, "device": vars(self.device), "dtype": self.dtype,
                "max_model_len": self.max_model_len, "block_size": self.block_size,
                "weight_bytes": self.weight_bytes, "activation_bytes": self.activation_bytes,
                "kv_bytes_per_token": self.roofline.kv_bytes_per_token, "kv_budget_bytes": self.kv_budget_bytes,
                "num_kv_blocks": self.num_kv_blocks, "step_seconds_lower_bound": self.step_seconds()}

    def render(self) -> str:
        d, r = self.device, self.roofline
        lines = [f"plan for {self.model_dir} ({self.dtype}) on {d.name} ({d.source}: "
                 f"{d.peak_flops / 1e12:.0f} TFLOP/s, {d.bandwidth / 1e12:.2f} TB/s, {d.memory_bytes / 1e9:.0f} GB)",
                 f"  max_model_len {self.max_model_len}, block_size {self.block_size}, max_num_seqs "
                 f"{self.max_num_seqs}, max_num_batched_tokens {self.max_num_batched_tokens}", "",
                 f"  {'weights':<48}{self.weight_bytes / MiB:10.1f} MiB   (from config.json)",
                 f"  {'activations of the largest step':<48}{self.activation_bytes / MiB:10.1f} MiB",
                 f"  {'KV bytes per token':<48}{r.kv_bytes_per_token:>10} B",
                 f"  {'KV budget':<48}{self.kv_budget_bytes / MiB:10.1f} MiB   ({self.kv_budget_source})",
                 f"  {'KV blocks':<48}{self.num_kv_blocks:>10}       x {self.block_size} tokens", ""]
        for label, seconds in self.step_seconds().items():
            lines.append(f"  {label:<48}{seconds * 1e3:10.3f} ms  (roofline lower bound)")
        lines += ["", f"  {'context':>8}{'blocks/req':>12}{'fit in KV':>11}{'concurrent':>12}  limited by"]
        for row in concurrency_table(self.num_kv_blocks, self.block_size, self.max_model_len, self.max_num_seqs):
            lines.append(f"  {row.context_len:>8}{row.blocks_per_request:>12}{row.fit_in_kv:>11}{row.concurrent:>12}"
                         f"  {row.limited_by}")
        if self.dtype == "float32":
            lines.append("  note: the datasheet peaks are dense BF16; a float32 model runs below them")
        return "\n".join(lines)


def build(model_dir: str, device_name: str, dtype: str = "bfloat16", max_model_len: int | None = None,
          block_size: int = 16, max_num_seqs: int = 128, max_num_batched_tokens: int = 2048,
          utilization: float | None = None, kv_cache_memory: int | None = None,
          num_kv_blocks: int | None = None) -> DevicePlan:
    """The plan of `model_dir` on the datasheet device `device_name`; the KV budget is `utilization` of its memory
    unless `kv_cache_memory` (bytes) or `num_kv_blocks` fixes it, as `shuttle serve` takes those flags.

    Raises:
        ValueError: an unknown device, a config.json without the model's dimensions, or an explicit KV budget that
            does not fit beside the weights and activations in the device's memory.
        ModelDirError: the model directory is unusable.
    """
    device = hardware.spec(device_name)
    model = ModelConfig.from_dir(model_dir, max_model_len, dtype=dtype)
    roofline = hardware.roofline_for(model.model_dir, dtype, device)
    tied = bool(json.loads((Path(model.model_dir) / "config.json").read_text()).get("tie_word_embeddings", False))
    plan = DevicePlan(model.model_dir, device, dtype, model.max_model_len, block_size, max_num_seqs,
                      max_num_batched_tokens, DEFAULT_UTILIZATION if utilization is None else utilization, roofline,
                      tied, kv_cache_memory, num_kv_blocks)
    if plan.num_kv_blocks < 1:
        raise ValueError(f"{plan.kv_budget_source} leaves the KV cache no block of {block_size} tokens "
                         f"({plan.roofline.kv_bytes_per_token} bytes per token)")
    over = plan.overcommitted_bytes()
    if over:
        raise ValueError(f"{plan.kv_budget_source} asks for {plan.kv_budget_bytes / MiB:.0f} MiB of KV cache, which "
                         f"does not fit in the {device.name}'s memory beside the weights and activations (over by "
                         f"{over / MiB:.0f} MiB)")
    return plan


def main(args) -> int:
    """`shuttle plan --device` (arguments from launcher/cli.py). Prints the plan (or JSON); 2 on bad input."""
    from shuttle.common.errors import ModelDirError

    if args.model_dir is None:
        print("shuttle: no MODEL_DIR given and the default ../shared/models/stories260K is missing", file=sys.stderr)
        return 2
    if getattr(args, "quantization", "none") != "none":
        print(f"shuttle: error: --quantization {args.quantization} runs on the CPU only; a --device plan is for the "
              f"datasheet's accelerator", file=sys.stderr)
        return 2
    if args.attention_backend != "auto":  # the datasheet plan has no backend: the roofline does not depend on it
        print(f"shuttle: error: --attention-backend {args.attention_backend}: a --device plan does not depend on "
              f"the attention backend; leave it out", file=sys.stderr)
        return 2
    try:
        dtype = resolve_dtype(args.dtype, "cuda")  # a datasheet accelerator: auto as serve resolves it on CUDA
        plan = build(args.model_dir, args.device, dtype, args.max_model_len, args.block_size,
                     args.max_num_seqs, args.max_num_batched_tokens, args.gpu_memory_utilization,
                     args.kv_cache_memory, args.num_kv_blocks)
    except (ModelDirError, ValueError) as exc:
        print(f"shuttle: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.render())
    return 0
