"""Which adapter sits in which device slot, host side (vLLM's fixed slots, apart from the KV
cache): adapters read from disk once into a host LRU of `max_cpu_loras`, copied into one of
`max_loras` device slots when a step needs them, the least recently used slot not needed by
the step evicted. Each step's rows find their slot through `kv_slot` [S]: the adapter slot of
every KV-cache slot (-1: the base model), read on the device (engine/step.py's forward_rows).

The scheduler admits a request only while the running requests' adapters, its own included,
fit the slots (engine/admission.py's adapter_fits): a request whose adapter finds no slot
waits.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from paged_jax.lora import weights as lw
from paged_jax.lora.config import LoRAConfig
from paged_jax.lora.peft_folder import load_peft
from paged_jax.lora.request import LoRARequest
from paged_jax.models import lora_ops
from paged_jax.models.config import ModelConfig


class AdapterManager:
    """Device slots and the host cache of adapters (module docstring)."""

    def __init__(self, config: ModelConfig, limits: LoRAConfig, num_kv_slots: int,
                 device=None, dtype: DTypeLike = jnp.float32):
        # the model's dtype where the delta runs on the C++ kernel or a GPU (a bfloat16
        # model's slots are half the bytes a step streams); float32 on XLA:CPU, whose
        # bfloat16 dots are slow
        on_xla_cpu = jax.default_backend() == "cpu" and not lora_ops.cpu_kernel()
        self.dtype = jnp.float32 if on_xla_cpu else jnp.dtype(dtype)
        self.config, self.max_loras = config, limits.max_loras
        self.rank, self.max_cpu, self.device = limits.max_lora_rank, limits.host_slots, device
        # committed to the engine's device: jit keys on placement (engine/runner.py)
        self.slots = jax.device_put(lw.empty_slots(config, self.max_loras, self.rank, self.dtype),
                                    device)
        self.host: OrderedDict[int, list] = OrderedDict()  # id -> slot values, LRU order
        self.resident: OrderedDict[int, int] = OrderedDict()  # id -> device slot, LRU order
        self.paths: dict[int, LoRARequest] = {}
        self.kv_slot = np.full(num_kv_slots, -1, np.int32)
        self.stats = dict(disk_loads=0, slot_writes=0, evictions=0, load_s=0.0, write_s=0.0)

    def check(self, lora: LoRARequest) -> None:
        """Reads the adapter now (into the host cache), so a bad one fails at submission; an
        id already known under another path is refused."""
        known = self.paths.get(lora.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) != (lora.lora_path,
                                                                        lora.lora_name):
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already {known.lora_name!r} "
                             f"at {known.lora_path}: each adapter needs its own id")
        if known is None:
            self.paths[lora.lora_int_id] = lora
        try:
            self._host_values(lora.lora_int_id)
        except Exception:  # a bad adapter leaves its id free for a good one
            if known is None:
                del self.paths[lora.lora_int_id]
            raise

    def _host_values(self, lora_id: int) -> list:
        if lora_id in self.host:
            self.host.move_to_end(lora_id)
            return self.host[lora_id]
        t0 = time.perf_counter()
        adapter = load_peft(self.paths[lora_id].lora_path, self.config, self.rank)
        values = lw.slot_values(self.config, adapter, self.rank, self.dtype)
        self.stats["disk_loads"] += 1
        self.stats["load_s"] += time.perf_counter() - t0
        self.host[lora_id] = values
        while len(self.host) > self.max_cpu:
            self.host.popitem(last=False)
        return values

    def place(self, rows: list[tuple[int, LoRARequest | None]]) -> bool:
        """Puts every adapter of `rows` (KV slot, adapter) in a device slot and records each
        KV slot's; True when `slots` or `kv_slot` changed (the runner re-reads them)."""
        needed = {lora.lora_int_id for _, lora in rows if lora is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step needs {len(needed)} adapters, {self.max_loras} slots")
        changed = False
        for lora_id in needed:
            if lora_id in self.resident:
                self.resident.move_to_end(lora_id)
                continue
            self._load(lora_id, needed)
            changed = True
        for kv, lora in rows:
            want = -1 if lora is None else self.resident[lora.lora_int_id]
            changed |= bool(self.kv_slot[kv] != want)
            self.kv_slot[kv] = want
        return changed

    def _load(self, lora_id: int, needed: set[int]) -> None:
        taken = set(self.resident.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:  # the least recently used adapter this step does not need
            victim = next(i for i in self.resident if i not in needed)
            slot = self.resident.pop(victim)
            self.stats["evictions"] += 1
        values = self._host_values(lora_id)
        t0 = time.perf_counter()
        self.slots = lw.write(self.slots, slot, values)
        self.stats["slot_writes"] += 1
        self.stats["write_s"] += time.perf_counter() - t0
        self.resident[lora_id] = slot

    def device_tree(self) -> dict:
        """What the forward reads: params["lora"]."""
        return dict(layers=self.slots, kv_slot=jax.device_put(self.kv_slot, self.device))
