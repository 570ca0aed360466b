"""Tensor parallelism for one serving group: N worker ranks, one process per device, joined by torch.distributed.

The sharding is transformers' own tensor-parallel plan (the model's `base_model_tp_plan` and `_tp_plan`, applied by
`from_pretrained(distributed_config=DistributedConfig(tp_size=N))`): q/k/v and MLP gate/up projections are split by
output columns (so each rank computes 1/N of the attention heads and KV heads), o_proj and down_proj by input rows,
their partial outputs all-reduced; the embedding is split by vocabulary rows (partial lookups summed) and the LM head by
vocabulary columns (gathered), so every rank ends a forward with the same full logits. On stories260K with gloo on a CPU
(tests/e2e/test_tensor_parallel.py): logits within 1e-5 of the unsharded model, greedy tokens identical.

What this module adds around it:
- the rendezvous: `torch.distributed.init_process_group` over tcp://master_addr:master_port (gloo on CPU, NCCL on
  CUDA), world size N, this process's rank;
- the refusals: heads or KV heads that N does not divide (checked before loading), an architecture without a plan,
  and a probed KV geometry that is not 1/N of the model's KV heads;
- the sampled tokens: rank 0 samples; the other ranks need those tokens as the next decode's input (each worker
  feeds its own samples forward), so rank 0 broadcasts them every step that samples.

Every rank runs the same plans in the same order, so their collectives pair up. A step that raises on one rank
would leave the others waiting in a collective, or pair the next step's collectives with this one's: so under
tensor parallel a failed step ends the worker process, and the launcher restarts the engine.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from shuttle.common.config import ParallelConfig, tensor_parallel_error
from shuttle.common.devices import DeviceError, rank_device, resolve_device
from shuttle.worker.model_loader import LayerGeometry, UnsupportedModelError

log = logging.getLogger("shuttle.worker")

# Longest a rank waits in one collective (the rendezvous included: ranks load the model at different speeds on a
# loaded machine). A rank stuck longer raises and exits; the scheduler's step watchdog usually notices first.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its group.

    Attributes:
        rank: 0..size-1; rank 0 samples and answers the scheduler.
        size: ranks in the group (1: no torch.distributed at all).
        device: this rank's device; collectives run on tensors there (NCCL needs CUDA tensors, gloo CPU ones).
    """

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def load_kwargs(self) -> dict:
        """Extra keywords for `from_pretrained`: transformers' tensor-parallel plan over this group."""
        if not self.enabled:
            return {}
        from transformers.distributed import DistributedConfig
        return {"distributed_config": DistributedConfig(tp_size=self.size)}

    def check_model(self, model: PreTrainedModel, geometry: list[LayerGeometry]) -> None:
        """Refuse a model the plan did not shard as expected: no plan, or KV heads that are not 1/N per rank.

        Raises:
            UnsupportedModelError: with the reason.
        """
        if not self.enabled:
            return
        name = type(model).__name__
        if not getattr(model, "_tp_plan", None):
            raise UnsupportedModelError(f"{name}: transformers has no tensor-parallel plan for it")
        config = getattr(model.config, "text_config", None) or model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        per_rank = {g.num_kv_heads for g in geometry}
        if per_rank != {kv_heads // self.size}:
            raise UnsupportedModelError(f"{name}: rank {self.rank} holds {sorted(per_rank)} KV heads per layer, not "
                                        f"{kv_heads} / {self.size}; its tensor-parallel plan does not split the heads")

    def share_tokens(self, token_ids: list[int] | None, count: int) -> list[int]:
        """Rank 0's sampled tokens, on every rank (a broadcast; rank 0 passes them, the others None).

        Args:
            token_ids: on rank 0, the `count` tokens it sampled; ignored elsewhere.
            count: how many tokens the step samples (every rank knows it from the plan).
        """
        if not self.enabled or count == 0:
            return list(token_ids or [])
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.device) if self.is_driver \
            else torch.empty(count, dtype=torch.long, device=self.device)
        dist.broadcast(tokens, src=0)
        return tokens.tolist()


def local_numel(tensor: torch.Tensor) -> int:
    """Elements this rank holds of a parameter (a DTensor's local shard, else the whole tensor)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local().numel() if to_local is not None else tensor.numel()


def local_device(spec: str, group: int, rank: int, tensor_parallel_size: int,
                 cuda_devices: int | None = None) -> torch.device:
    """The device this worker process owns: `spec` (--device, normally resolved by the launcher to cpu or cuda:N;
    auto is resolved here) for rank `rank` of local serving group `group` (common/devices.rank_device).

    Args:
        cuda_devices: CUDA devices present (None: torch.cuda.device_count(); tests pass fabricated counts).
    Raises:
        DeviceError: the device is not there (a remote `shuttle engine`, or devices hidden since the launcher
            counted them).
    """
    if cuda_devices is None:
        cuda_devices = torch.cuda.device_count() if spec != "cpu" and torch.cuda.is_available() else 0
    first = resolve_device(spec, cuda_devices)
    own = rank_device(first, group, rank, tensor_parallel_size)
    if own != "cpu" and int(own.split(":")[1]) >= cuda_devices:
        raise DeviceError(f"--device {spec}: rank {rank} of serving group {group} would own {own}, but this machine "
                          f"has {cuda_devices} CUDA device(s)")
    return torch.device(own)


def join_group(parallel: ParallelConfig, rank: int, model_dir: str, hf_config: dict,
               device: torch.device = torch.device("cpu")) -> TensorParallel:
    """Check that the model splits into `parallel.tensor_parallel_size` ranks, then join the group's rendezvous:
    NCCL when `device` is CUDA (the process's current CUDA device is set to it first, which is also the device
    transformers' tensor-parallel loading binds), gloo on the CPU.

    Returns at once (TensorParallel() of size 1 on `device`) without tensor parallelism.

    Raises:
        UnsupportedModelError: heads or KV heads not divisible by the size (before any rank loads the model).
        ValueError: a rank outside 0..size-1.
    """
    size = parallel.tensor_parallel_size
    if size == 1:
        return TensorParallel(device=device)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside 0..{size - 1}")
    refusal = tensor_parallel_error(hf_config, size)
    if refusal:
        raise UnsupportedModelError(f"{model_dir}: {refusal}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # transformers binds its tensor-parallel device mesh to cuda:$LOCAL_RANK (torchrun's name), 0 when unset
        os.environ["LOCAL_RANK"] = str(device.index)
    init_method = f"tcp://{parallel.master_addr}:{parallel.master_port}"
    log.info("rank %d of %d: joining the %s group at %s", rank, size, backend, init_method)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    return TensorParallel(rank, size, device)
