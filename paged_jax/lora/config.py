"""The engine's adapter limits (vLLM's names)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Attributes:
      max_loras: device slots: the most distinct adapters among running requests (a request
        whose adapter finds no slot waits).
      max_lora_rank: the slots' rank R (an adapter of rank r <= R fills r of it; a larger one
        is refused when submitted).
      max_cpu_loras: adapters kept read in host memory (LRU), at least max_loras.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras={self.max_loras}, "
                             f"got {cpu!r}")

    @property
    def host_slots(self) -> int:
        return self.max_cpu_loras or self.max_loras
