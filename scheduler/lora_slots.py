"""Which LoRA adapter sits in each of the worker's --max-loras slots, and who may take one.

A running request holds its adapter's slot; a slot no running request holds is idle and keeps its adapter (a later
request for it needs no load) until another adapter needs the room, the least recently used idle slot first. A
slot changing hands is a LoRALoad in the next plan (common/messages.py), applied by the worker before that step.
"""

from __future__ import annotations

from shuttle.common.lora import LoRAConfig, LoRAModule
from shuttle.common.messages import LoRALoad


class LoRASlots:
    """The scheduler's view of the worker's adapter slots.

    Args:
        num_slots: --max-loras.
        modules: the served adapters (--lora-modules), by name.
    """

    def __init__(self, num_slots: int, modules: tuple[LoRAModule, ...]):
        self.modules = {m.name: m for m in modules}
        self.names: list[str | None] = [None] * num_slots
        self.holders = [0] * num_slots  # running requests holding each slot
        self._last_used = [0] * num_slots
        self._clock = 0
        self.pending: list[LoRALoad] = []  # loads for the next plan

    def key(self, name: str) -> str:
        """What names adapter `name`'s weights in prefix-cache digests: its name and directory."""
        return f"{name}\0{self.modules[name].path}" if name else ""

    def can_take(self, name: str) -> bool:
        """Whether a request for `name` could get a slot now (its adapter's, a free one or an idle one)."""
        return name in self.names or any(h == 0 for h in self.holders)

    def take(self, name: str) -> int:
        """A slot holding `name` for one more running request, loading it into the least recently used idle slot
        when no slot holds it.

        Raises:
            RuntimeError: no slot can take it (check can_take first).
        """
        self._clock += 1
        if name in self.names:
            slot = self.names.index(name)
        else:
            idle = [s for s, h in enumerate(self.holders) if h == 0]
            if not idle:
                raise RuntimeError(f"no LoRA slot free for {name!r}")
            slot = min(idle, key=lambda s: (self.names[s] is not None, self._last_used[s]))
            self.names[slot] = name
            self.pending = [load for load in self.pending if load.slot != slot]
            self.pending.append(LoRALoad(slot=slot, name=name, path=self.modules[name].path))
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
        return sorted(name for name, holders in zip(self.names, self.holders) if name is not None and holders)


def lora_slots_for(config: LoRAConfig) -> LoRASlots | None:
    """The slots of a server started with --enable-lora (None without it)."""
    return LoRASlots(config.max_loras, config.lora_modules) if config.enable_lora else None
