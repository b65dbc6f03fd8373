"""The KV manager's host mirror against the device (KVManager.check, for tests): the free
count, live slots, lengths, cached and evictable blocks, with the queued ops taken into
account (they apply at the start of the next call)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from paged_jax.cache.invariants import InvariantError, check_invariants

if TYPE_CHECKING:
    from paged_jax.cache.page_table import PageTable
    from paged_jax.cache.pool import BlockPool
    from paged_jax.cache.prefix_cache import PrefixCache
    from paged_jax.engine.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class Mirror:
    """The KV manager's host facts that the device must agree with."""

    num_free: int
    slot_live: np.ndarray
    owners: dict[int, Sequence]
    prefix: PrefixCache | None
    release: dict  # slots with a release queued for the next call
    forks: list[tuple[int, int]]  # forks queued for the next call
    evict: list[int]  # evictions queued for the next call
    unmark: list[int]  # cached marks the next call drops


def mirror_errors(kv: Mirror, pool: BlockPool, table: PageTable) -> list[str]:
    """Every difference between the host facts `kv` and the device's pool and page tables."""
    num_free, dev_live, lens, cached, ref = (np.asarray(x) for x in (
        pool.num_free, table.live, table.seq_lens, pool.cached, pool.refcount))
    errors = []
    if int(num_free) != kv.num_free:
        errors.append(f"free count: host {kv.num_free}, device {int(num_free)}")
    live = kv.slot_live.copy()
    live[[dst for _, dst in kv.forks]] = False  # forked in the next call
    live[list(kv.release)] = True  # released in the next call, first (a fork may reuse it)
    if not np.array_equal(live, dev_live):
        errors.append(f"live slots: host {np.nonzero(live)[0]}, "
                      f"device {np.nonzero(dev_live)[0]}")
    for slot, seq in kv.owners.items():
        if slot not in kv.release and dev_live[slot] and lens[slot] != seq.num_computed:
            errors.append(f"slot {slot}: host length {seq.num_computed}, device {lens[slot]}")
    if kv.prefix is not None:
        host = set(kv.prefix.hash_of) | set(kv.evict) | set(kv.unmark)
        if set(np.nonzero(cached)[0].tolist()) != host:
            errors.append(f"cached blocks: host {sorted(host)}, "
                          f"device {np.nonzero(cached)[0].tolist()}")
        idle = set(np.nonzero(cached & (ref == 0))[0].tolist()) - set(kv.unmark)
        if idle != set(kv.prefix.evictable) | set(kv.evict):
            errors.append(f"evictable: host {sorted(kv.prefix.evictable)} + queued "
                          f"{kv.evict}, device {sorted(idle)}")
    return errors


def check_manager(mirror: Mirror, device, in_flight: bool) -> None:
    """Asserts a KV manager's host mirror equals the device: free count, live slots, lengths,
    cached and evictable blocks, and the allocator invariants (reads the device; tests call
    it after every step, with no call in flight)."""
    if in_flight:
        raise InvariantError("a call's output is unread: the mirror is not exact yet")
    pool, table = device.snapshot()
    check_invariants(pool, table)
    if errors := mirror_errors(mirror, pool, table):
        raise InvariantError("host mirror != device: " + "; ".join(errors))
