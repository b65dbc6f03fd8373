"""Hypothesis state machine: random add / append / fork / shared writes / release / exhaustion.

The plain-Python model keeps, per sequence, its token values and a list of *abstract* block
ids (fresh ids on allocation, shared on fork, replaced on copy-on-write). It predicts exactly
how many blocks are in use and when the pool runs out. After every step the device state must
satisfy every invariant, map one-to-one onto the model's blocks, and read back each sequence's
own K/V values through its block table.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from paged_jax.cache import kv_quant
from paged_jax.cache.config import CacheConfig
from paged_jax.cache.invariants import check_invariants
from paged_jax.cache.kv_cache import init_kv_cache
from paged_jax.cache.page_table import add_sequence, fork, init_page_table, release
from paged_jax.cache.pool import init_pool
from tests.allocator_helpers import make_append

CFG = CacheConfig(num_blocks=14, block_size=4, max_seqs=5, max_blocks_per_seq=5)
MAX_NEW = 2 * CFG.block_size + 1
T = CFG.max_seqs * MAX_NEW


_append = make_append(CFG, MAX_NEW)
_fork = jax.jit(fork)
_release = jax.jit(release)
_add = jax.jit(add_sequence)


class AllocatorMachine(RuleBasedStateMachine):
    KV_DTYPE, RTOL = jnp.float32, 0.0  # the cache's dtype, and how exactly values read back

    def __init__(self):
        super().__init__()
        self.pool = init_pool(CFG.num_blocks)
        self.table = init_page_table(CFG)
        self.cache = init_kv_cache(1, 1, CFG.num_blocks, CFG.block_size, 1, self.KV_DTYPE)
        self.values = {}  # slot -> list of token values
        self.blocks = {}  # slot -> list of abstract block ids
        self.fresh = itertools.count(1)
        self.next_value = itertools.count(1)

    # ---- model helpers -------------------------------------------------------------------
    def free_slots(self):
        return [s for s in range(CFG.max_seqs) if s not in self.values]

    def model_used(self):
        return len({b for bl in self.blocks.values() for b in bl})

    def holders(self, b):
        return sum(bl.count(b) for bl in self.blocks.values())

    def model_append(self, num_new):
        """Returns blocks needed, or applies the append to the model if it fits."""
        k, plan, need = CFG.block_size, {}, 0
        writers = {}
        for s, n in num_new.items():
            old = len(self.values[s])
            if n and old % k:
                writers.setdefault(self.blocks[s][-1], []).append(s)
        for s, n in num_new.items():
            old = len(self.values[s])
            grow = -(-(old + n) // k) - (-(-old // k))
            last = self.blocks[s][-1] if old % k and n else None
            copy = last is not None and self.holders(last) > 1 and not (
                len(writers[last]) == self.holders(last) and writers[last][0] == s)
            plan[s] = (grow, copy)
            need += grow + copy
            if -(-(old + n) // k) > CFG.max_blocks_per_seq:
                return None
        if need > CFG.num_blocks - 1 - self.model_used():
            return None
        return plan

    # ---- rules ---------------------------------------------------------------------------
    @initialize()
    def first_sequence(self):
        self.table = _add(self.table, 0)
        self.values[0], self.blocks[0] = [], []

    @precondition(lambda self: len(self.values) < CFG.max_seqs)
    @rule(data=st.data())
    def add(self, data):
        slot = data.draw(st.sampled_from(self.free_slots()))
        self.table = _add(self.table, slot)
        self.values[slot], self.blocks[slot] = [], []

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def append(self, data):
        live = sorted(self.values)
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
        counts = {s: data.draw(st.integers(0, MAX_NEW), label=f"n{s}") for s in chosen}
        self._append(counts)

    @precondition(lambda self: any(len(v) % CFG.block_size for v in self.values.values()))
    @rule(data=st.data())
    def write_into_shared_block(self, data):
        """Fork a sequence with a partly filled block, then write one token into it."""
        part = [s for s, v in self.values.items() if len(v) % CFG.block_size]
        src = data.draw(st.sampled_from(part))
        if self.free_slots():
            self._fork(src, self.free_slots()[0])
        self._append({src: 1})

    @precondition(lambda self: self.values and len(self.values) < CFG.max_seqs)
    @rule(data=st.data())
    def fork(self, data):
        self._fork(data.draw(st.sampled_from(sorted(self.values))),
                   data.draw(st.sampled_from(self.free_slots())))

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def release(self, data):
        gone = data.draw(st.lists(st.sampled_from(sorted(self.values)), min_size=1, unique=True))
        mask = jnp.array([s in gone for s in range(CFG.max_seqs)])
        self.pool, self.table = _release(self.pool, self.table, mask)
        for s in gone:
            del self.values[s], self.blocks[s]

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def exhaust(self, data):
        """Ask for more than the pool holds: must fail cleanly and change nothing."""
        s = data.draw(st.sampled_from(sorted(self.values)))
        free_tokens = (CFG.num_blocks - 1 - self.model_used()) * CFG.block_size
        self._append({s: min(MAX_NEW, free_tokens + CFG.block_size + 1)})

    # ---- operations on both ----------------------------------------------------------------
    def _fork(self, src, dst):
        self.pool, self.table = _fork(self.pool, self.table, jnp.array([src]), jnp.array([dst]))
        self.values[dst] = list(self.values[src])
        self.blocks[dst] = list(self.blocks[src])

    def _append(self, counts):
        plan = self.model_append(counts)
        num_new = np.zeros(CFG.max_seqs, np.int32)
        vals = np.zeros((CFG.max_seqs, MAX_NEW), np.float32)
        new_vals = {}
        for s, n in counts.items():
            num_new[s] = n
            new_vals[s] = [float(next(self.next_value)) for _ in range(n)]
            vals[s, :n] = new_vals[s]
        before = jax.tree.leaves((self.pool, self.table))
        self.pool, self.table, self.cache, ok, copies = _append(
            self.pool, self.table, self.cache, jnp.asarray(num_new), jnp.asarray(vals.reshape(-1)))
        assert bool(ok) == (plan is not None), f"device ok={bool(ok)} but model plan={plan}"
        if plan is None:
            event("pool exhausted or sequence too long: no change")
            for a, b in zip(before, jax.tree.leaves((self.pool, self.table)), strict=True):
                np.testing.assert_array_equal(a, b)
            return
        assert int(copies) == sum(c for _, c in plan.values()), "copy-on-write count differs"
        for s, (grow, copy) in plan.items():
            if copy:
                event("copy-on-write")
                self.blocks[s][-1] = next(self.fresh)
            self.blocks[s] += [next(self.fresh) for _ in range(grow)]
            self.values[s] += new_vals[s]

    # ---- checks after every step ---------------------------------------------------------
    @invariant()
    def allocator_invariants_hold(self):
        check_invariants(self.pool, self.table)
        assert CFG.num_blocks - 1 - int(self.pool.num_free) == self.model_used()

    @invariant()
    def sharing_matches_model(self):
        """Physical ids map one-to-one onto the model's abstract ids."""
        tables, fwd, back = np.asarray(self.table.block_tables[0]), {}, {}
        for s, bl in self.blocks.items():
            assert tables[s, : len(bl)].tolist() != [] or not bl
            for phys, abst in zip(tables[s, : len(bl)].tolist(), bl, strict=True):
                assert fwd.setdefault(phys, abst) == abst and back.setdefault(abst, phys) == phys

    @invariant()
    def contents_read_back(self):
        k, v = (np.asarray(x[0, 0, :, :, 0]) for x in self.cache.stacked())  # dequantized
        tables = np.asarray(self.table.block_tables[0])
        for s, vals in self.values.items():
            n = len(vals)
            got_k = k[tables[s]].reshape(-1)[:n]
            got_v = v[tables[s]].reshape(-1)[:n]
            np.testing.assert_allclose(got_k, vals, rtol=self.RTOL)
            np.testing.assert_allclose(got_v, [-x for x in vals], rtol=self.RTOL)
        stored = [np.asarray(x[0][0, 0]) for x in (self.cache.k, self.cache.v,
                                                   self.cache.k_scale, self.cache.v_scale) if x]
        assert not any(x.any() for x in stored), "the zero block was written"


AllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestAllocatorMachine = AllocatorMachine.TestCase


class DeepAllocatorMachine(AllocatorMachine):
    """The same machine, searched longer: the slow tier (tests/conftest.py)."""


DeepAllocatorMachine.TestCase.settings = settings(AllocatorMachine.TestCase.settings,
                                                  max_examples=250)
TestDeepAllocatorMachine = DeepAllocatorMachine.TestCase


def _over(name: str, rtol: float, examples: int):
    """The same machine on a bfloat16 / int8 / fp8 cache: values (and scales) must follow
    their blocks through writes, forks and copy-on-write copies; fewer examples (the block
    logic is the float32 machine's; the slow tier's `Deep` twins search longer)."""
    cls = type(f"AllocatorMachine_{name}_{examples}", (AllocatorMachine,),
               dict(KV_DTYPE=kv_quant.storage_dtype(name, jnp.float32), RTOL=rtol))
    cls.TestCase.settings = settings(AllocatorMachine.TestCase.settings,
                                     max_examples=examples)
    return cls.TestCase


# bfloat16 keeps 8 significant bits, e4m3 4; int8 stores each one-value row as +-127 x scale.
TestAllocatorMachineBfloat16 = _over("bfloat16", 2.0**-8, 12)
TestAllocatorMachineInt8 = _over("int8", 1e-6, 12)
TestAllocatorMachineFp8 = _over("fp8", 2.0**-4, 12)
TestDeepAllocatorMachineBfloat16 = _over("bfloat16", 2.0**-8, 40)
TestDeepAllocatorMachineInt8 = _over("int8", 1e-6, 40)
TestDeepAllocatorMachineFp8 = _over("fp8", 2.0**-4, 40)
