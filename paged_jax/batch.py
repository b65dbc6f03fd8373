"""Host side of a step: pads a scheduler plan into device arrays and picks its static shape.

Every static shape the engine compiles comes from the bucket rules here, so a step costs what
its work costs while the number of compiled programs stays small:

    decode window (W decode steps, the hot loop):
      rows R          next power of two of the running sequences (from 1)
    ragged step (prefill chunks, admissions, forks; its cost is mostly its T tokens):
      rows R          next power of two of the rows (sequences + n > 1 children), at least S/4
      tokens T        decode-only: R; with prefill chunks: budget / 4 or budget (two buckets)
      max_q           1 (decodes), T / 8 (every chunk short), or T
      max_q_rows      1, 4 or R rows with more than one token (they come first)
      admissions A    max_num_seqs entries
    both:
      pages           only for attention backends whose cost follows a page bucket (the jnp
                      reference, Pallas): max_pages = next power of two of the longest row's
                      pages (from 1, at most P); for the reference's flat decode list,
                      decode_pages = next power of two of the single-token rows' pages
                      together (a window counts them at its end). The CPU kernel walks each
                      row's own pages and needs neither.
      max_copies      0, or R when any row's last block may be shared (forks, prefix hits)
      flags           the sampler features the rows' requests asked for (SampleFlags.of)
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged_jax import sampling as smp
from paged_jax.prefix_cache import Hit
from paged_jax.scheduler import Plan
from paged_jax.sequence import Sequence
from paged_jax.sizes import cdiv, next_pow2
from paged_jax.step import Admissions, StepBatch, StepShape


def page_bucket(num_tokens: int, ec) -> int:
    """Static page count covering `num_tokens` tokens: a power of two, at most P."""
    p = cdiv(ec.max_model_len, ec.block_size)
    return min(next_pow2(cdiv(num_tokens, ec.block_size)), p)


def decode_page_bucket(lengths: list[int], ec, rows: int) -> int:
    """Flat page bucket of single-token rows of these lengths (at most rows x P)."""
    p = cdiv(ec.max_model_len, ec.block_size)
    return min(next_pow2(sum(cdiv(n, ec.block_size) for n in lengths)), rows * p)


@dataclasses.dataclass
class Admit:
    """A slot going live in the next step (Admissions row, host side).

    Attributes:
      seq: the sequence taking the slot.
      new_request: its request is admitted for the first time: write its sampling row.
      seed: the seed used when the request has none of its own.
      hit: the prefix-cache hit to attach (None: none).
    """

    seq: Sequence
    new_request: bool
    seed: int
    hit: Hit | None = None


PAGED_COST_BACKENDS = ("reference", "pallas")
"""Attention backends whose cost follows the static page buckets."""


def _flags(rows: list[Sequence], ec) -> smp.SampleFlags:
    reqs = {id(s.owner): s.owner for s in rows}.values()
    return smp.SampleFlags.of([r.params for r in reqs], ec.max_logprobs)


def _copies(chunks: list[tuple[Sequence, int]], ec, rows: int) -> int:
    """Copy-on-write bound: all rows when any writes into a last block that may be shared
    (as kv_manager.blocks_needed counts them), else none."""
    k = ec.block_size
    shared = any(seq.maybe_shared_last and seq.num_computed % k and c for seq, c in chunks)
    return rows if shared else 0


def build_admissions(
    admits: list[Admit], ec, flags: smp.SampleFlags, eos_ids: list[int], vocab_size: int
) -> Admissions:
    """Admissions padded to max_num_seqs rows (one transfer per array group)."""
    a, p = ec.max_num_seqs, cdiv(ec.max_model_len, ec.block_size)
    slot = np.full(a, -1, np.int32)
    new = np.zeros(a, bool)
    hit_blocks, hit_tokens = np.zeros((a, p), np.int32), np.zeros(a, np.int32)
    mask = np.zeros((a, vocab_size), bool) if flags.penalties else None
    bias = np.zeros((a, vocab_size), np.float32) if flags.bias else None
    items = []
    for i, adm in enumerate(admits):
        slot[i], new[i] = adm.seq.slot, adm.new_request
        req = adm.seq.owner
        items.append((req.params, eos_ids, adm.seed))
        if adm.hit is not None:
            hit_blocks[i, :len(adm.hit.blocks)] = adm.hit.blocks
            hit_tokens[i] = adm.hit.num_tokens
        if mask is not None:
            mask[i, req.prompt_token_ids] = True
        if bias is not None and req.params.has_logit_bias:
            bias[i] = smp.bias_row(req.params, vocab_size, req.banned_ids)
    arrays = jax.device_put(dict(slot=slot, new_request=new, prompt_mask=mask,
                                 logit_bias=bias, hit_blocks=hit_blocks, hit_tokens=hit_tokens))
    return Admissions(sampling=smp.sampling_rows(items, a, smp.MAX_STOP_IDS), **arrays)


def build_step(
    plan: Plan, ec, admits: list[Admit], eos_ids: list[int], vocab_size: int, backend: str
) -> tuple[StepBatch, StepShape, list[tuple[Sequence, list[Sequence]]], list[Sequence]]:
    """Pads a plan into a StepBatch: long chunks first, then single tokens, then fork children.

    Args:
      plan: the scheduler's plan.
      ec: the engine config.
      admits: slots going live in this step.
      eos_ids: the model's EOS ids (written into new requests' sampling rows).
      vocab_size: V.
      backend: the attention backend (decides whether page buckets matter).

    Returns:
      (batch, shape, forks [(parent, children)], rows: the sequence of each row).
    """
    chunks = sorted(plan.chunks, key=lambda c: c[1] == 1)
    forks = [(seq, seq.owner.seqs[1:]) for seq, n in chunks
             if seq.num_computed + n == len(seq.tokens) and seq.owner.params.n > 1
             and not seq.owner.forked and seq.index == 0]
    rows = [seq for seq, _ in chunks] + [c for _, cs in forks for c in cs]
    r = next_pow2(len(rows), ec.max_num_seqs // 4)
    total = sum(n for _, n in chunks)
    num_long = sum(1 for _, n in chunks if n > 1)
    top = next_pow2(ec.max_num_batched_tokens)
    t = next_pow2(total, max(8, top // 4)) if num_long else r
    t = top if num_long and t > top // 4 else t
    tok, pos, rows_of = np.zeros(t, np.int32), np.zeros(t, np.int32), np.full(t, -1, np.int32)
    row_slots, qs, sample = np.full(r, -1, np.int32), np.zeros(r + 1, np.int32), np.zeros(r, bool)
    o = 0
    for i, (seq, n) in enumerate(chunks):
        a = seq.num_computed
        tok[o:o + n], pos[o:o + n], rows_of[o:o + n] = seq.tokens[a:a + n], np.arange(a, a + n), i
        row_slots[i], sample[i] = seq.slot, a + n == len(seq.tokens)
        o += n
        qs[i + 1] = o
    qs[len(chunks) + 1:] = o
    row_of = {id(s): i for i, s in enumerate(rows)}
    pairs = [(row_of[id(p)], row_of[id(c)], c.index) for p, cs in forks for c in cs]
    for i, c in enumerate(rows[len(chunks):], start=len(chunks)):
        row_slots[i], sample[i] = c.slot, True
    f = next_pow2(len(pairs))
    fs, fd, fi = (np.full(f, -1, np.int32) for _ in range(3))
    for j, (a, b, c) in enumerate(pairs):
        fs[j], fd[j], fi[j] = a, b, c
    shape = _step_shape(chunks, t, r, rows, ec, backend)
    next_ids = _next_ids(chunks, t)
    if next_ids is not None:
        shape = dataclasses.replace(shape, prompt_top=ec.max_logprobs)
    if any(seq.wants_hidden(n) for seq, n in chunks):
        shape = dataclasses.replace(shape, hidden=True)
    arrays = jax.device_put((tok, pos, rows_of, row_slots, qs, sample, fs, fd, fi, next_ids))
    admit = build_admissions(admits, ec, shape.flags, eos_ids, vocab_size)
    return StepBatch(*arrays[:-1], admit=admit, next_ids=arrays[-1]), shape, forks, rows


def _next_ids(chunks: list[tuple[Sequence, int]], t: int) -> np.ndarray | None:
    """[T] the prompt token after each token of rows that want prompt logprobs (-1 else);
    None when no row in the step does."""
    out, o = None, 0
    for seq, n in chunks:
        if seq.owner.params.prompt_logprobs is not None and seq.num_computed < seq.prompt_len:
            out = np.full(t, -1, np.int32) if out is None else out
            nxt = np.arange(seq.num_computed + 1, seq.num_computed + n + 1)
            ok = nxt < seq.prompt_len
            out[o:o + n] = np.where(ok, np.asarray(seq.tokens)[np.where(ok, nxt, 0)], -1)
        o += n
    return out


def _step_shape(chunks, t: int, r: int, rows: list[Sequence], ec, backend: str) -> StepShape:
    # Queries per long row: the whole bucket, or an eighth of it when every chunk is short
    # (many small prefill chunks, e.g. after prefix-cache hits: the reference pads each row).
    longest = max(n for _, n in chunks)
    num_long = sum(1 for _, n in chunks if n > 1)
    max_q = 1 if not num_long else max(1, t // 8) if longest <= t // 8 else t
    long_rows = None if not num_long else 1 if num_long == 1 else 4 if num_long <= 4 else r
    paged = backend in PAGED_COST_BACKENDS
    return StepShape(
        max_q=max_q, max_q_rows=min(long_rows, r) if long_rows else None,
        max_new_blocks=next_pow2(cdiv(max_q, ec.block_size) + 1),
        max_copies=_copies(chunks, ec, r),
        max_pages=page_bucket(max(s.num_computed + n for s, n in chunks), ec) if paged else None,
        flags=_flags(rows, ec))


def build_window(
    plan: Plan, ec, backend: str
) -> tuple[np.ndarray, np.ndarray, StepShape, list[Sequence]]:
    """A decode window's rows: (row_slots [R], tokens [R], shape, rows)."""
    rows = [seq for seq, _ in plan.chunks]
    r, w = next_pow2(len(rows)), ec.decode_window
    row_slots, tokens = np.full(r, -1, np.int32), np.zeros(r, np.int32)
    for i, seq in enumerate(rows):
        row_slots[i], tokens[i] = seq.slot, seq.tokens[-1]
    ends = [seq.num_computed + w for seq in rows]
    flat = backend == "reference"
    shape = StepShape(
        max_q=1, max_copies=_copies(plan.chunks, ec, r),
        max_pages=page_bucket(max(ends), ec) if backend == "pallas" else None,
        decode_pages=decode_page_bucket(ends, ec, r) if flat else None, flags=_flags(rows, ec))
    return row_slots, tokens, shape, rows
