"""Which LoRA adapter sits in each of the worker's --max-loras slots, and who may take one.

An adapter is named here by its key, "NAME\\0PATH\\0LOAD_ID" (scheduler/request.py `lora_key`), as each request
carries all three from the frontend, whose registry (the --lora-modules, then runtime loads and unloads) is the one
list of served adapters: an adapter unloaded and loaded again under the same name, from another directory or from
the same one (whose files may have changed), is another key, so neither a slot nor the prefix cache serves the old
weights for it. A running request holds its adapter's slot; a slot no running request holds is
idle and keeps its adapter (a later request for it needs no load) until another adapter needs the room, the least
recently used idle slot first. A slot changing hands is a LoRALoad in the next plan (common/messages.py), applied by
the worker before that step.
"""

from __future__ import annotations

from shuttle.common.lora import LoRAConfig
from shuttle.common.messages import LoRALoad


def adapter_key(name: str, path: str, load_id: str) -> str:
    """The key naming one load of an adapter (module docstring); `key_parts` reads it back."""
    return f"{name}\0{path}\0{load_id}"


def key_parts(key: str) -> tuple[str, str, str]:
    """(name, path, load id) of an adapter_key (a name may hold a NUL; a path or a load id does not)."""
    name, path, load_id = key.rsplit("\0", 2)
    return name, path, load_id


class LoRASlots:
    """The scheduler's view of the worker's adapter slots.

    Args:
        num_slots: --max-loras.
    """

    def __init__(self, num_slots: int):
        self.keys: list[str | None] = [None] * num_slots
        self.holders = [0] * num_slots  # running requests holding each slot
        self._last_used = [0] * num_slots
        self._clock = 0
        self.pending: list[LoRALoad] = []  # loads for the next plan

    def can_take(self, key: str) -> bool:
        """Whether a request for adapter `key` could get a slot now (its adapter's, a free one or an idle one)."""
        return key in self.keys or any(h == 0 for h in self.holders)

    def take(self, key: str) -> int:
        """A slot holding adapter `key` for one more running request, loading it into the least recently used idle
        slot when no slot holds it.

        Raises:
            RuntimeError: no slot can take it (check can_take first).
        """
        self._clock += 1
        if key in self.keys:
            slot = self.keys.index(key)
        else:
            idle = [s for s, h in enumerate(self.holders) if h == 0]
            if not idle:
                raise RuntimeError(f"no LoRA slot free for {key_parts(key)[0]!r}")
            slot = min(idle, key=lambda s: (self.keys[s] is not None, self._last_used[s]))
            self.keys[slot] = key
            name, path, _ = key_parts(key)
            self.pending = [load for load in self.pending if load.slot != slot]
            self.pending.append(LoRALoad(slot=slot, name=name, path=path))
        self.holders[slot] += 1
        self._last_used[slot] = self._clock
        return slot

    def give_back(self, slot: int) -> None:
        """One running request stopped holding `slot` (finished, aborted or preempted); the adapter stays."""
        self.holders[slot] -= 1

    def take_loads(self) -> list[LoRALoad]:
        """The loads the next plan carries (each once)."""
        loads, self.pending = self.pending, []
        return loads

    @property
    def running_names(self) -> list[str]:
        """Adapters that running requests use now (vLLM's lora_requests_info running_lora_adapters)."""
        return sorted(key.partition("\0")[0] for key, holders in zip(self.keys, self.holders)
                      if key is not None and holders)


def lora_slots_for(config: LoRAConfig) -> LoRASlots | None:
    """The slots of a server started with --enable-lora (None without it)."""
    return LoRASlots(config.max_loras) if config.enable_lora else None
