"""The host's one owner of KV-cache facts (vLLM V1's KVCacheManager, nano-vllm's BlockManager).

The device holds the block pool, the page tables and the K/V (pytrees in the runner's
EngineState, changed only by the pure functions of paged_jax/cache). Every host fact about
them is written here and nowhere else:

    num_free       the device free stack's size after the last call (that call's output)
    free_slots     page-table rows no sequence owns; `owners`: slot -> its sequence
    slot_live      rows live on the device once the next call's ops and admissions apply
    prefix         the prefix cache: hashes of full blocks, LRU queue of cached-free blocks
    queued ops     allocator work for the next call: releases, evictions, forks
    on a Sequence  slot, num_computed, draft_computed, maybe_shared_last, swapped,
                   prefix_hit, block_hashes
    swapped_bytes  host memory held by swapped-out K/V

No device -> host read happens for bookkeeping. The device settles what it decides itself
(step.settle: stopped sequences released, full blocks marked cached); what only the host knows
(stop strings, aborts, preemptions, evictions, forks) rides in the next call (cache/ops.py).
A call's one output brings back the free count, newly full blocks and refcounts.

    plan time   free_total() = confirmed free stack + evictable + queued evictions, less
                  what calls sent and not read yet may take (async scheduling)
                pending_free() = what queued releases may give back (an upper bound: a
                  block shared with a live sequence stays held); counted once confirmed
                make_room / bring_live / take_ops -> the ops and the call's Sent record
    sent        advance(chunks): the computed counts, as soon as a step is sent
    after       update_from_output(rows, out, sent): flags, registrations, the free count
    freeing     free(seqs) (finish, abort; slots returned) and preempt(seqs) (slots kept)

`check()` asserts this mirror equals the device (engine/mirror.py). A *slot* is a sequence's
row of the page table; a *block* is a page of the pool.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from paged_jax.cache.config import CacheConfig
from paged_jax.cache.ops import no_ops
from paged_jax.cache.prefix_cache import Hit, PrefixCache
from paged_jax.engine.mirror import Mirror, check_manager
from paged_jax.engine.plan import Admit, Sent
from paged_jax.engine.sequence import Request, Sequence
from paged_jax.sizes import cdiv


class Device(Protocol):
    """What the KV manager reads of the device outside calls (swap-outs, checks)."""

    def read_blocks(self, slot: int) -> tuple[np.ndarray, ...]: ...
    def snapshot(self) -> dict[str, np.ndarray]: ...


class KVManager:
    """Host facts of one engine's KV cache (see the module docstring).

    Args:
      cc: pool and page-table shape.
      block_bytes: bytes of one block's K/V over all layers (swap-space accounting).
      device: the runner (swap-outs and `check` read through it).
      prefix_caching: keep full blocks for reuse across requests (cache/prefix_cache.py).
      swap: preemption copies a sequence's blocks to the host instead of dropping them.
      swap_space: bytes of host memory swapped-out blocks may take; past it, a preempted
        sequence is recomputed instead (nothing is lost either way).
    """

    def __init__(self, cc: CacheConfig, block_bytes: int, device: Device | None = None, *,
                 prefix_caching: bool = True, swap: bool = False, swap_space: int = 4 << 30):
        self.config, self.device, self.block_bytes, self.swap = cc, device, block_bytes, swap
        self.swap_space, self.swapped_bytes, self.num_free = swap_space, 0, cc.usable_blocks
        self.free_slots: list[int] = list(range(cc.max_seqs - 1, -1, -1))
        self.owners: dict[int, Sequence] = {}
        self.slot_live = np.zeros(cc.max_seqs, bool)
        self.prefix = PrefixCache(cc.block_size, cc.windows) if prefix_caching else None
        self._windows = any(w is not None for w in cc.windows)  # they free blocks every step
        self._reset_ops()
        self._outstanding: list[Sent] = []  # calls sent whose output is not read yet
        self._need = 0  # blocks the plan being made may take (room_for)
        self._acquired: set[int] = set()  # cached blocks the plan being made's hits take
        self._device_released: set[int] = set()  # slots the last call released itself
        self._copied = False  # a prefix hit's last block is copied in the next call

    def _reset_ops(self) -> None:
        self._release: dict[int, tuple[Sequence, int]] = {}  # slot -> (sequence, tokens held)
        self._evict: list[int] = []  # LRU victims: cached-free, back on the stack
        self._unmark: list[int] = []  # blocks marked cached that the prefix cache does not keep
        self._forks: list[tuple[int, int]] = []
        self._release_hi = 0  # blocks the queued releases may free, at most

    # ---- capacity ------------------------------------------------------------------------
    def free_total(self) -> int:
        """Blocks a plan may use now: the confirmed free stack, evictable cached-free blocks,
        and evictions queued for the next call."""
        evictable = len(self.prefix.evictable) if self.prefix else 0
        return self._stack() + evictable + len(self._evict)

    def _stack(self) -> int:
        """The free stack once the calls sent and not read yet have run (at least): the
        last count read, plus their evictions, less what their plans may take."""
        return self.num_free + sum(s.evicted - s.need for s in self._outstanding)

    def pending_free(self) -> int:
        """Blocks queued releases may give back once the device confirms them (at most)."""
        return self._release_hi

    def blocks_used(self) -> int:
        """Blocks held by sequences (cached-free blocks count as free, as in vLLM; blocks a
        queued release frees count as held until the device has freed them)."""
        return self.config.usable_blocks - self.free_total()

    def usage(self) -> float:
        """Share of the pool's blocks in use (vLLM's kv_cache_usage_perc)."""
        return self.blocks_used() / max(1, self.config.usable_blocks)

    def blocks_needed(self, seq: Sequence, n: int) -> int:
        """Upper bound on the blocks `seq` gains by computing `n` more tokens (copy included)."""
        cc, k = self.config, self.config.block_size
        restore = cc.blocks_for(seq.num_computed) if seq.swapped is not None else 0
        # Every group takes the new columns; sliding ones drop old ones after the step (slide).
        grow = cdiv(seq.num_computed + n, k) - cdiv(seq.num_computed, k)
        return restore + cc.num_groups * (grow + int(seq.copies_on_write(n, k)))

    def has_ops(self) -> bool:
        return bool(self._release or self._evict or self._unmark or self._forks)

    # ---- slots ---------------------------------------------------------------------------
    def can_allocate(self, seqs: list[Sequence]) -> bool:
        """Whether every sequence without a slot can get one now."""
        return sum(s.slot < 0 for s in seqs) <= len(self.free_slots)

    def allocate(self, seqs: list[Sequence]) -> None:
        """Gives every sequence without a slot one (held until it is freed)."""
        for s in seqs:
            if s.slot < 0:
                s.slot = self.free_slots.pop()
                self.owners[s.slot] = s

    # ---- prefix cache --------------------------------------------------------------------
    def cached_tokens(self, ids: list[int]) -> int:
        """Prompt tokens the prefix cache would serve for a prompt (0 without caching)."""
        if self.prefix is None or len(ids) < 2:
            return 0
        return self.prefix.lookup(Sequence(0, list(ids), len(ids))).num_tokens

    def try_hit(self, req: Request) -> Hit | None:
        """Starts a fresh request's first sequence at its cached prefix, tentatively
        (`undo_hit` if it is not admitted). Requests that want prompt logprobs compute
        every prompt token, so they never hit."""
        seq = req.seqs[0]
        if self.prefix is None or not self.fresh(req) or req.params.prompt_logprobs is not None:
            return None
        hit = self.prefix.lookup(seq)
        if not hit.blocks:
            return None
        seq.num_computed = hit.num_tokens
        seq.maybe_shared_last = hit.num_tokens % self.config.block_size != 0  # copy counted
        seq.prefix_hit = hit
        return hit

    def undo_hit(self, seq: Sequence) -> None:
        seq.num_computed, seq.maybe_shared_last, seq.prefix_hit = 0, False, None

    def admit_hit(self, req: Request, hit: Hit | None, first_time: bool) -> None:
        """The admitted request's hit blocks are in use (no longer evictable); a request's
        first admission counts toward the hit rate, as vLLM reports it."""
        if self.prefix is None:
            return
        if first_time:
            req.num_cached_tokens = hit.num_tokens if hit else 0
            self.prefix.count(len(req.seqs[0].tokens), req.num_cached_tokens)
        if hit:
            self.prefix.acquire(hit)
            self._acquired.update(hit.blocks)

    @staticmethod
    def fresh(req: Request) -> bool:
        """A request whose single sequence holds no K/V (new, or preempted by recompute)."""
        s = req.seqs[0]
        return not req.forked and s.num_computed == 0 and s.swapped is None

    # ---- before a call -------------------------------------------------------------------
    def make_room(self, blocks: int) -> None:
        """Queues evictions of cached-free blocks (least recently used first) until the
        device free stack will hold `blocks`, or the prefix cache has nothing left."""
        have = self._stack() + len(self._evict)
        if self.prefix is None or blocks <= have:
            return
        self._evict += self.prefix.evict(blocks - have)

    def room_for(self, chunks: list[tuple[Sequence, int]], decode_only: bool) -> None:
        """make_room for a plan. A decode window may grow every sequence once more inside
        the loop, so it gets one block of headroom per sequence."""
        need, g = sum(self.blocks_needed(s, n) for s, n in chunks), self.config.num_groups
        self._need = max(need, len(chunks) * g) if decode_only else need
        self.make_room(self._need)

    def settled(self, req: Request) -> bool:
        """No slot of the request has a release queued (a preempted one comes back later)."""
        return all(s.slot not in self._release for s in req.seqs)

    def bring_live(self, seqs: list[Sequence]) -> tuple[list[Admit], list[tuple]]:
        """Slots going live in the next call: (admissions, with their prefix hits and no
        seeds yet; swap-ins (slot, tokens, host K/V parts) restored after the call's ops)."""
        admits, restores = [], []
        for seq in seqs:
            if self.slot_live[seq.slot]:
                continue
            self.slot_live[seq.slot] = True
            seq.draft_computed = 0 if seq.swapped is not None else seq.num_computed  # draft.py
            if seq.swapped is not None:
                restores.append((seq.slot, seq.num_computed, seq.swapped))
                self.swapped_bytes -= len(seq.swapped[0]) * self.block_bytes
                seq.swapped = None
                continue
            hit, seq.prefix_hit = seq.prefix_hit, None
            if hit is not None and hit.num_tokens % self.config.block_size:
                self._copied = True  # the call copies the hit's last block: it may go free
            admits.append(Admit(seq, False, 0, hit))
        return admits, restores

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Queues forks that give each child a slot sharing all of `parent`'s blocks (beam
        search; n > 1 requests fork inside their step). The first write into a shared, partly
        filled last block copies it (copy-on-write)."""
        if not self.can_allocate(children):
            raise RuntimeError(f"{len(children)} forks need free sequence slots; "
                               f"{len(self.free_slots)} left (raise max_num_seqs)")
        self.allocate(children)
        self.live_children(parent, children)
        self._forks += [(parent.slot, c.slot) for c in children]

    def live_children(self, parent: Sequence, children: list[Sequence]) -> None:
        """Children that now share the parent's blocks (forked in a step or queued)."""
        shared = parent.num_computed % self.config.block_size != 0
        parent.maybe_shared_last |= shared
        for c in children:
            c.num_computed, c.maybe_shared_last = parent.num_computed, shared
            c.draft_computed = parent.draft_computed
            self.slot_live[c.slot] = True

    def take_ops(self) -> tuple[dict[str, np.ndarray] | None, Sent]:
        """The queued ops as host arrays for the next call (None: nothing queued), and the
        call's Sent record (its output's update_from_output takes it back; `forget` it if
        the call is not made)."""
        sent = Sent(list(self._release.values()), self._need, len(self._evict), self._acquired)
        self._need, self._acquired = 0, set()
        self._outstanding.append(sent)
        if not self.has_ops():
            return None, sent
        cc = self.config
        ops = no_ops(cc.num_blocks, cc.max_seqs)
        ops["release"][list(self._release)] = True
        ops["evict"][self._evict + self._unmark] = True
        for i, (src, dst) in enumerate(self._forks):
            ops["fork_src"][i], ops["fork_dst"][i] = src, dst
        self._reset_ops()
        return ops, sent

    def forget(self, sent: Sent) -> None:
        """A plan that ran no call (nothing to do): its record goes."""
        self._outstanding.remove(sent)

    def in_flight(self) -> bool:
        """Whether a sent call's output is still unread."""
        return bool(self._outstanding)

    def advance(self, chunks: list[tuple[Sequence, int]], draft: bool = False) -> None:
        """Counts a sent step's tokens as computed (its output may come a step later); a
        writer owns its last block after it. `draft`: a draft model read them too (draft.py)."""
        for seq, n in chunks:
            if draft and seq.draft_computed == seq.num_computed:
                seq.draft_computed += n
            seq.num_computed += n
            if n:
                seq.maybe_shared_last = False

    def advance_draft(self, seq: Sequence, catchup: tuple[int, int], drafts: int,
                      start: int) -> None:
        """After a draft model's verify call: the draft holds its catch-up and the kept drafts
        but the last (a row may stop early): it rereads that one (catch-up is padded to 2)."""
        first, n = catchup
        seq.draft_computed = min(seq.num_computed - 1, start + drafts) if drafts else first + n

    # ---- after a call --------------------------------------------------------------------
    def update_from_output(self, rows: list[tuple[Sequence, int, int]], out, sent: Sent,
                           dead: dict[int, int] | None = None) -> None:
        """Takes the output of the call `sent` records: the free count; per row (sequence,
        start, tokens computed; `dead`: row -> slot, see `_undo_dead`) that the device settled
        (Request.device_settles), blocks it marked cached registered (or unmarked if not
        kept) and a stop noted as released (`free` then does only the host's part); cached
        blocks that reached refcount 0 join the LRU queue."""
        self.num_free = int(out.num_free)
        self._outstanding.remove(sent)
        gone = list(sent.releases)
        self._device_released = set()
        for i, (seq, start, n) in enumerate(rows):
            owned = seq.owner.device_settles
            full = out.full_blocks[i] if owned and self.prefix is not None else None
            if dead and i in dead:
                self._undo_dead(seq, start + n, dead[i], full, owned and out.finished[i], gone)
                continue
            if full is not None and full.shape[0]:
                self._register(seq, start, start + n, full)
            if owned and out.finished[i] and seq.slot >= 0:
                self._device_released.add(seq.slot)
                gone.append((seq, start + n))
        if self.prefix is not None and (gone or self._copied or self._windows):
            # Blocks later calls' hits took are in use, whatever these refcounts say.
            taken = set().union(self._acquired, *(s.acquired for s in self._outstanding))
            self.prefix.on_release(out.refcount, self._cached_blocks(gone), taken)
            self._copied = False

    def _undo_dead(self, seq: Sequence, held: int, slot: int, full: np.ndarray | None,
                   released: bool, gone: list) -> None:
        """A row of a sequence the host finished while its call ran: its cached marks are
        dropped; if the device released its slot (it stopped), so is the queued release."""
        if full is not None:
            self._unmark += [int(b) for b in full if b]
        if released:
            gone.append((seq, held))
            if slot in self._release and self._release[slot][0] is seq:
                del self._release[slot]

    def _register(self, seq: Sequence, before: int, after: int, full: np.ndarray) -> None:
        """Registers the blocks the device marked cached for `seq` as it went from `before`
        to `after` computed tokens (`full`: [G * F] its newly full columns' blocks per group,
        PrefixCache.register_call); those it does not keep are queued for eviction."""
        k = self.config.block_size
        self._unmark += self.prefix.register_call(seq, before // k, full, after // k - before // k)

    # ---- freeing -------------------------------------------------------------------------
    def free(self, seqs: list[Sequence]) -> None:
        """Frees finished or aborted sequences: their blocks (released in the next call,
        unless the device already released them when they stopped), slots and swap space.
        The one way a sequence's KV goes away for good."""
        for s in seqs:
            if s.slot in self._device_released:
                self._device_released.discard(s.slot)
                self.slot_live[s.slot] = False
        self._release_blocks(seqs)
        for s in seqs:
            if s.swapped is not None:
                self.swapped_bytes -= len(s.swapped[0]) * self.block_bytes
                s.swapped = None
            if s.slot >= 0:
                self.owners.pop(s.slot, None)
                self.free_slots.append(s.slot)
                s.slot = -1

    def preempt(self, seqs: list[Sequence], swap: bool = True) -> int:
        """Preempts running sequences: their blocks are released in the next call (swapped
        out first while swap space lasts, if `swap` and not a queued fork's child; else
        recomputed later); they keep their slots (and sampling state). Returns what this may
        give back (see pending_free)."""
        hi, forked = self._release_hi, {dst for _, dst in self._forks}
        for s in seqs:
            size = self.config.blocks_for(s.num_computed) * self.block_bytes
            if swap and self.swap and self.swapped_bytes + size <= self.swap_space and (
                    s.slot not in forked):
                s.swapped = self._swap_out(s)
                self.swapped_bytes += size
        self._release_blocks(seqs)
        for s in seqs:
            s.maybe_shared_last = False
            if s.swapped is None:
                s.num_computed = 0  # recompute
        return self._release_hi - hi

    def _release_blocks(self, seqs: list[Sequence]) -> None:
        """Queues releases of their blocks; a child whose fork is queued holds none: its fork
        is dropped (a queued release of its slot's earlier owner stays: releases run first)."""
        for s in seqs:
            if s.slot >= 0 and self.slot_live[s.slot]:
                self.slot_live[s.slot] = False
                if s.slot in {dst for _, dst in self._forks}:
                    self._forks = [f for f in self._forks if f[1] != s.slot]
                    continue
                self._release[s.slot] = (s, s.num_computed)
                self._release_hi += self.config.blocks_for(s.num_computed)

    def _cached_blocks(self, released: list[tuple[Sequence, int]]) -> list[int]:
        """Cached blocks the released sequences held, tail first (PrefixCache.chain_blocks)."""
        k = self.config.block_size
        return [b for s, held in released for b in self.prefix.chain_blocks(s, held // k)]

    # ---- swap space and checks -------------------------------------------------------------
    def _swap_out(self, seq: Sequence) -> tuple[np.ndarray, ...]:
        """Host copies of the sequence's blocks in every group: where they sat, K, V (and
        their scales when quantized); runner.read_blocks."""
        return self.device.read_blocks(seq.slot)

    def check(self) -> None:  # this host mirror equals the device (engine/mirror.py)
        check_manager(Mirror(self.num_free, self.slot_live, self.owners, self.prefix,
                             self._release, self._forks, self._evict, self._unmark),
                      self.device, self.in_flight())
