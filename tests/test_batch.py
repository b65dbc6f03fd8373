"""batch.py's bucket rules, the sampler's static flags, and the step's copy-on-write bound."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.cache import page_table as pt
from paged_jax.engine import batch as batch_lib
from paged_jax.engine.plan import Plan
from paged_jax.engine.sequence import Request, Sequence, Status
from paged_jax.engine.step import StepShape, run_step
from paged_jax.engine.window import decode_batch
from paged_jax.sample.sampler import SampleFlags
from paged_jax.sampling_params import SamplingParams
from tests.engine_helpers import BASE, BUCKETS, GREEDY, engine, run

EC = engine(**BUCKETS).config  # block 8, 8 slots, budget 64, max_model_len 256 (P = 32)


def running(n: int, length: int = 20, params: SamplingParams = GREEDY) -> list[Sequence]:
    seqs = []
    for i in range(n):
        req = Request(str(i), None, [1] * length, params, 0.0, order=i)
        seq = Sequence(0, [1] * length, length, slot=i, num_computed=length - 1,
                       status=Status.RUNNING, owner=req)
        req.seqs = [seq]
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("n, rows", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8)])
def test_window_rows_follow_the_running_sequences(n, rows):
    row_slots, tokens, shape, seqs = batch_lib.build_window(
        Plan(chunks=[(s, 1) for s in running(n)]), EC, "cpu")
    assert row_slots.shape == (rows,) and list(row_slots[:n]) == list(range(n))
    assert (row_slots[n:] == -1).all() and len(seqs) == n and tokens.shape == (rows,)
    # The kernel walks each row's pages: no page bucket, so no shape per context length.
    assert shape.max_pages is None and shape.decode_pages is None and shape.max_copies == 0


def test_reference_pages_follow_the_live_contexts_not_max_model_len():
    short = Plan(chunks=[(s, 1) for s in running(3, length=20)])
    _, _, shape, _ = batch_lib.build_window(short, EC, "reference")
    # 3 rows of 19 + W = 27 tokens at the window's end: 4 pages each, 12 together -> 16.
    assert shape.decode_pages == 16 and shape.max_pages is None
    _, _, pallas, _ = batch_lib.build_window(short, EC, "pallas")
    assert pallas.max_pages == 4 < -(-EC.max_model_len // EC.block_size)


def test_ragged_step_shapes():
    seqs = running(3, length=30)
    seqs[0].num_computed = 0  # a 30-token prefill chunk beside two decodes
    plan = Plan(chunks=[(seqs[0], 30), (seqs[1], 1), (seqs[2], 1)])
    batch, shape, forks, rows = batch_lib.build_step(plan, EC, [256], 257, "reference")
    assert rows[0] is seqs[0] and not forks
    assert batch.row_slots.shape == (EC.max_num_seqs,)  # with a prefill: every slot's row
    assert batch.token_ids.shape == (64,)  # budget 64: token buckets 16 and 64
    assert shape.max_q_rows == 1 and shape.max_pages == 4 and shape.max_copies == 0
    assert batch.admit.slot.shape == (EC.max_num_seqs,) and (np.asarray(batch.admit.slot) < 0).all()


@pytest.mark.parametrize("prompt, tokens", [(16, 16), (17, 24), (41, 48), (49, 64), (65, 96),
                                           (100, 128), (129, 512)])
def test_prefill_token_buckets_pad_at_most_a_third(prompt, tokens):
    """Budget 512: buckets 16, 24, 32, 48, 64, 96, 128, then the budget."""
    ec = dataclasses.replace(EC, max_num_batched_tokens=512, max_num_seqs=8)
    seq = running(1, length=prompt)[0]
    seq.num_computed = 0
    assert batch_lib._step_buckets([(seq, prompt)], 1, ec) == (8, tokens)


def test_decode_only_steps_follow_the_running_sequences_and_admit_nothing():
    """Async scheduling's hot loop: rows from 1, no admission rows unless a slot joins."""
    for n, rows in [(1, 1), (3, 4), (5, 8)]:
        plan = Plan(chunks=[(s, 1) for s in running(n, length=30)])
        batch, shape, _, _ = batch_lib.build_step(plan, EC, [256], 257, "cpu")
        assert batch.row_slots.shape == batch.token_ids.shape == (rows,) and shape.max_q == 1
        assert batch.admit is None


def test_copies_are_bounded_by_the_rows_that_may_share():
    seqs = running(4, length=21)  # 20 computed: the last block (8 per block) is partial
    seqs[1].maybe_shared_last = seqs[3].maybe_shared_last = True
    _, _, shape, _ = batch_lib.build_window(Plan(chunks=[(s, 1) for s in seqs]), EC, "cpu")
    assert shape.max_copies == 4  # one bucket: every row may copy
    for s in seqs[1], seqs[3]:
        s.num_computed = 16  # block-aligned: the write starts a new block, nothing to copy
    _, _, shape, _ = batch_lib.build_window(Plan(chunks=[(s, 1) for s in seqs]), EC, "cpu")
    assert shape.max_copies == 0


def test_flags_follow_the_requests():
    of = lambda *ps: SampleFlags.of(list(ps), num_top_logprobs=4)  # noqa: E731
    assert of(GREEDY) == SampleFlags(False, False, False, False, 0, False)
    assert of(GREEDY, SamplingParams(temperature=0.7)).random
    assert not of(SamplingParams(temperature=0.7)).filters
    assert of(SamplingParams(temperature=0.7, top_p=0.9)).filters
    assert not of(SamplingParams(temperature=0.0, top_k=5)).filters  # greedy ignores filters
    assert of(SamplingParams(repetition_penalty=1.1)).penalties
    lp = of(SamplingParams(logprobs=0))
    assert lp.logprobs and lp.num_top_logprobs == 0
    assert of(SamplingParams(logprobs=2)).num_top_logprobs == 4


def test_cumulative_logprob_only_when_asked():
    logprobs = dataclasses.replace(GREEDY, logprobs=0)
    outs = run(engine(**BUCKETS), [("a", "x", GREEDY), ("b", "x", logprobs)])
    assert outs["a"].outputs[0].cumulative_logprob is None
    assert outs["b"].outputs[0].cumulative_logprob < 0


def test_a_copy_beyond_max_copies_is_refused_not_written():
    """Two slots share a partly filled block; a write needs a copy. Told that no row may
    share (max_copies 0) the step refuses (ok False, nothing changed); with 1 it copies."""
    eng = engine(**BUCKETS)
    st = eng.state
    table = pt.add_sequence(st.table, 0)
    pool, table, _, _ = pt.reserve_tokens(st.pool, table, jnp.zeros(8, jnp.int32).at[0].set(5))
    pool, table = pt.fork(pool, table, jnp.array([0]), jnp.array([1]))
    eng.runner.state = st = dataclasses.replace(st, pool=pool, table=table)
    batch = decode_batch(jnp.array([1]), jnp.array([7]), jnp.array([True]), table.seq_lens)
    flags = SampleFlags(False, False, False, False, 0, False)
    st, out = run_step(eng.params, st, batch, cfg=eng.runner.cfg,
                       shape=StepShape(max_q=1, flags=flags))
    assert not bool(out.ok) and int(st.table.seq_lens[1]) == 5
    st, out = run_step(eng.params, st, batch, cfg=eng.runner.cfg,
                       shape=StepShape(max_q=1, max_copies=1, flags=flags))
    assert bool(out.ok) and int(st.table.seq_lens[1]) == 6
    rows = np.asarray(st.table.block_tables[0])
    assert rows[0, 0] != rows[1, 0], "the writer got a private copy"
    assert BASE["block_size"] == 8
