"""Host side of a device call: pads a scheduler plan into device arrays and picks its static
shape (`build`: a plan -> a Call, the runner's one jitted call).

Every static shape the engine compiles comes from the bucket rules here, so a step costs what
its work costs while the number of compiled programs stays small:

    decode window (W decode steps, the hot loop):
      rows R          next power of two of the running sequences (from 1)
    ragged step (prefill chunks, admissions, forks; its cost is mostly its T tokens):
      rows R          with prefill chunks: S (every slot: one row bucket at any load);
                      decode-only (async scheduling's hot loop) and verify: power of two
                      from 1
      tokens T        decode-only: R; verify (decodes with drafts): 2^k or 3 * 2^(k-1)
                      of the tokens (5 pad to 6, not 8); with prefill chunks: 2^k or
                      3 * 2^(k-1) from 16 up to budget / 4, else the budget (a short
                      prompt's step costs what its tokens cost, not a 128-token step:
                      `experiments.weight_layout`; a 41-token prompt pads to 48, not 64)
      max_q           1 (decodes), T / 8 (every chunk short; for the backends whose cost
                      follows it: the jnp reference, Pallas), or T
      max_q_rows      the jnp reference only (it pads each long row to max_q): 1, 4 or R
                      rows with more than one token (they come first); None elsewhere
      admissions A    max_num_seqs entries (none in a decode-only step that admits nothing)
    verify with a draft model: its catch-up tokens C a half octave of theirs, its max_q the
      next power of two of the longest row's
    both:
      pages           only for attention backends whose cost follows a page bucket (the jnp
                      reference, Pallas): max_pages = next power of two of the longest row's
                      pages (from 1, at most P); for the reference's flat decode list,
                      decode_pages = next power of two of the single-token rows' pages
                      together (a window counts them at its end). The CPU kernel walks each
                      row's own pages and needs neither.
      max_copies      0, or R * G (G KV cache groups) when any row's last block may be shared
                      (forks, prefix hits)
      flags           the sampler features the rows' requests asked for (SampleFlags.of)
      full_width      with prefix caching, the most blocks a row can fill: cdiv(max_q, K)
                      for a step, cdiv(W, K) for a window (0 without: nothing reported)
    ops               always sent (no-op arrays when nothing is queued): one program either way
    static_shapes     (EngineConfig) every bucket at its largest and every sampler feature on:
                      R = max_num_seqs, T = the budget, max_q = T, P pages; one program per
                      kind of call (the sampler's flags only ever skip work: same tokens)
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged_jax.cache.ops import KVOps, no_ops
from paged_jax.engine.draft import DraftBatch
from paged_jax.engine.plan import Admit, Plan
from paged_jax.engine.sequence import Sequence
from paged_jax.engine.step import Admissions, StepBatch, StepShape
from paged_jax.sample import grammar
from paged_jax.sample import sampler as smp
from paged_jax.sizes import cdiv, next_half_octave, next_pow2


def page_bucket(num_tokens: int, ec) -> int:
    """Static page count covering `num_tokens` tokens: a power of two, at most P."""
    p = cdiv(ec.max_model_len, ec.block_size)
    return min(next_pow2(cdiv(num_tokens, ec.block_size)), p)


def decode_page_bucket(lengths: list[int], ec, rows: int) -> int:
    """Flat page bucket of single-token rows of these lengths (at most rows x P)."""
    p = cdiv(ec.max_model_len, ec.block_size)
    return min(next_pow2(sum(cdiv(n, ec.block_size) for n in lengths)), rows * p)


@dataclasses.dataclass
class Call:
    """A plan as one jitted call (the runner picks the program by `kind`).

    Attributes:
      kind: "step" (run_step), "window" (decode_window), "verify" (run_verify: speculative
        decoding) or "ops" (run_ops).
      rows: the sequence of each row, in row order (steps: long chunks first, then single
        tokens, then n > 1 fork children).
      ops: the allocator ops, always present.
      shape: static bounds (None for "ops").
      batch: the step's batch ("step", "verify").
      window: (row_slots [R], tokens [R]) of a decode window ("window").
      forks: (parent, children) pairs the step forks (n > 1 requests finishing their prompt).
      draft: a verify call's draft-model catch-up (engine/draft.py), None without one.
    """

    kind: str
    rows: list[Sequence]
    ops: KVOps
    shape: StepShape | None = None
    batch: StepBatch | None = None
    window: tuple[jax.Array, jax.Array] | None = None
    forks: list[tuple[Sequence, list[Sequence]]] = dataclasses.field(default_factory=list)
    draft: DraftBatch | None = None


def build(plan: Plan, ec, eos_ids: list[int], vocab_size: int, backend: str) -> Call:
    """The call that runs `plan` (see Call)."""
    ops = build_ops(plan.ops, ec)
    if not plan.chunks:
        return Call("ops", [], ops)
    if any(s.matcher is not None and (plan.window or s.num_placeholders)
           for s, _ in plan.chunks):
        raise RuntimeError("a constrained sequence was planned into a decode window or ahead "
                           "of its last token: its mask cannot be known (a scheduler bug)")
    if plan.window:
        row_slots, tokens, shape, rows = build_window(plan, ec, backend)
        return Call("window", rows, ops, shape, window=(row_slots, tokens))
    batch, shape, forks, rows = build_step(plan, ec, eos_ids, vocab_size, backend)
    if plan.drafts or plan.catchup:  # speculative decoding (engine/verify.py): decodes only
        shape = dataclasses.replace(shape, verify=ec.speculative.k + 1)
        own = np.arange(batch.row_slots.shape[0]) < len(rows)
        draft = None
        if ec.speculative.draft_model:
            draft, q = build_draft(plan, rows, batch.row_slots.shape[0])
            shape = dataclasses.replace(shape, draft_q=q)
        return Call("verify", rows, ops, shape, dataclasses.replace(batch, ops=ops, own=own),
                    draft=draft)
    own = np.zeros(batch.row_slots.shape[0], bool)  # padding rows own nothing
    own[:len(rows)] = [s.owner.device_settles for s in rows]
    return Call("step", rows, ops, shape, dataclasses.replace(batch, ops=ops, own=own),
                forks=forks)


def build_draft(plan: Plan, rows: list[Sequence], r: int) -> tuple[DraftBatch, int]:
    """A verify call's draft-model catch-up over its R rows, and its max_q bucket: tokens
    padded to 2R (a speculating row catches up 1-2 tokens) or, when more, a half octave;
    max_q at least 2; rows to R. One shape per row bucket in steady decoding."""
    spans = [plan.catchup.get(id(s), (0, 0)) for s in rows]
    c = max(2 * r, next_half_octave(max(1, sum(n for _, n in spans))))
    tok, pos, rows_of = np.zeros(c, np.int32), np.zeros(c, np.int32), np.full(c, -1, np.int32)
    qs, lens, num = np.zeros(r + 1, np.int32), np.zeros(r, np.int32), np.zeros(r, np.int32)
    o = 0
    for i, (seq, (first, n)) in enumerate(zip(rows, spans, strict=True)):
        tok[o:o + n], pos[o:o + n] = seq.tokens[first:first + n], np.arange(first, first + n)
        rows_of[o:o + n], lens[i] = i, first + n if n else 0
        num[i] = len(plan.drafts.get(id(seq), ()))
        o += n
        qs[i + 1] = o
    qs[len(rows) + 1:] = o
    return (DraftBatch(tok, pos, rows_of, seq_lens=lens, num_drafts=num, query_start=qs),
            next_pow2(max(n for _, n in spans), 2))


def build_ops(ops: dict[str, np.ndarray] | None, ec) -> KVOps:
    """The plan's allocator ops as device arrays (no-ops when none are queued)."""
    return KVOps(**(ops or no_ops(ec.num_kv_blocks, ec.max_num_seqs)))


PAGED_COST_BACKENDS = ("reference", "pallas", "pallas-triton", "pallas-mosaic")
"""Attention backends whose cost follows the static page buckets."""


def _flags(rows: list[Sequence], ec) -> smp.SampleFlags:
    reqs = {id(s.owner): s.owner for s in rows}.values()
    # J: max_logprobs, or a beam search's (2W; every token's under a logit bias)
    j = max([ec.max_logprobs] + [r.beam.num_logprobs for r in reqs if r.beam is not None])
    if ec.static_shapes:  # every feature on but structured outputs' masks (sent when needed)
        return smp.SampleFlags(num_top_logprobs=j, grammar=any(s.matcher is not None for s in rows))
    return smp.SampleFlags.of([r.params for r in reqs], j)


def _copies(chunks: list[tuple[Sequence, int]], ec, rows: int) -> int:
    """Copy-on-write bound: all rows when any writes into a last block that may be shared
    (as the KV manager counts them), else none."""
    shared = any(seq.copies_on_write(c, ec.block_size) for seq, c in chunks)
    return rows * ec.num_groups if shared or ec.static_shapes else 0


def build_admissions(
    admits: list[Admit], ec, flags: smp.SampleFlags, eos_ids: list[int], vocab_size: int
) -> Admissions:
    """Admissions padded to max_num_seqs rows (numpy: the jitted call copies them in)."""
    a, p = ec.max_num_seqs, cdiv(ec.max_model_len, ec.block_size)
    slot = np.full(a, -1, np.int32)
    new = np.zeros(a, bool)
    hit_blocks, hit_tokens = np.zeros((a, ec.num_groups, p), np.int32), np.zeros(a, np.int32)
    mask = np.zeros((a, vocab_size), bool) if flags.penalties else None
    bias = np.zeros((a, vocab_size), np.float32) if flags.bias else None
    items = []
    for i, adm in enumerate(admits):
        slot[i], new[i] = adm.seq.slot, adm.new_request
        req = adm.seq.owner
        items.append((req.params, eos_ids, adm.seed))
        if adm.hit is not None:
            for g, cols in enumerate(adm.hit.columns):  # 0 before a sliding group's window
                hit_blocks[i, g, :len(cols)] = cols
            hit_tokens[i] = adm.hit.num_tokens
        if mask is not None:
            mask[i, req.prompt_token_ids] = True
        if bias is not None and req.params.has_logit_bias:
            bias[i] = smp.bias_row(req.params, vocab_size, req.banned_ids)
    arrays = dict(slot=slot, new_request=new, prompt_mask=mask, logit_bias=bias,
                  hit_blocks=hit_blocks, hit_tokens=hit_tokens)
    return Admissions(sampling=smp.sampling_rows(items, a, smp.MAX_STOP_IDS), **arrays)


def build_step(
    plan: Plan, ec, eos_ids: list[int], vocab_size: int, backend: str
) -> tuple[StepBatch, StepShape, list[tuple[Sequence, list[Sequence]]], list[Sequence]]:
    """Pads a plan into a StepBatch: long chunks first, then single tokens, then fork children.

    Args:
      plan: the scheduler's plan (its chunks and the slots it admits).
      ec: the engine config.
      eos_ids: the model's EOS ids (written into new requests' sampling rows).
      vocab_size: V.
      backend: the attention backend (decides whether page buckets matter).

    Returns:
      (batch, shape, forks [(parent, children)], rows: the sequence of each row).
    """
    chunks = sorted(plan.chunks, key=lambda c: c[1] == 1)
    forks = [(seq, seq.owner.seqs[1:]) for seq, n in chunks
             if seq.num_computed + n == seq.length and seq.owner.params.n > 1
             and not seq.owner.forked and seq.index == 0]
    rows = [seq for seq, _ in chunks] + [c for _, cs in forks for c in cs]
    verify = bool(plan.drafts or plan.catchup)
    r, t = _step_buckets(chunks, len(rows), ec, verify)
    tok, pos, rows_of = np.zeros(t, np.int32), np.zeros(t, np.int32), np.full(t, -1, np.int32)
    row_slots, qs, sample = np.full(r, -1, np.int32), np.zeros(r + 1, np.int32), np.zeros(r, bool)
    o = 0
    for i, (seq, n) in enumerate(chunks):
        a, drafts = seq.num_computed, plan.drafts.get(id(seq), [])
        # tokens not known yet were sampled in the step before and are still on the device
        known = seq.tokens[a:a + n] + drafts
        tok[o:o + len(known)], tok[o + len(known):o + n] = known, -1
        pos[o:o + n], rows_of[o:o + n] = np.arange(a, a + n), i
        row_slots[i], sample[i] = seq.slot, a + n == seq.length or bool(drafts)
        o += n
        qs[i + 1] = o
    qs[len(chunks) + 1:] = o
    row_of = {id(s): i for i, s in enumerate(rows)}
    pairs = [(row_of[id(p)], row_of[id(c)], c.index) for p, cs in forks for c in cs]
    for i, c in enumerate(rows[len(chunks):], start=len(chunks)):
        row_slots[i], sample[i] = c.slot, True
    f = ec.max_num_seqs if ec.static_shapes else next_pow2(len(pairs))
    fs, fd, fi = (np.full(f, -1, np.int32) for _ in range(3))
    for j, (a, b, c) in enumerate(pairs):
        fs[j], fd[j], fi[j] = a, b, c
    shape = _step_shape(chunks, t, r, rows, ec, backend, verify and _drafting_model(ec))
    next_ids = _next_ids(chunks, t)
    if next_ids is not None:
        shape = dataclasses.replace(shape, prompt_top=ec.max_logprobs)
    if any(seq.wants_hidden(n) for seq, n in chunks):
        shape = dataclasses.replace(shape, hidden=True)
    shape = dataclasses.replace(shape, lora=runs_adapters(rows, ec))
    masks = _masks(plan, rows, sample, qs, t, vocab_size, eos_ids) if shape.flags.grammar \
        else None
    arrays = (tok, pos, rows_of, row_slots, qs, sample, fs, fd, fi, next_ids)
    # A decode-only step with nothing to admit (the async hot loop) sends no admission rows:
    # a program of its own, and a dozen fewer host -> device copies per step.
    none = not plan.admits and (shape.max_q == 1 or plan.drafts) and not ec.static_shapes
    admit = None if none else build_admissions(plan.admits, ec, shape.flags, eos_ids,
                                               vocab_size)
    return (StepBatch(*arrays[:-1], admit=admit, next_ids=arrays[-1], masks=masks), shape,
            forks, rows)


def runs_adapters(rows: list[Sequence], ec) -> bool:
    """Whether a call adds LoRA deltas: some row runs an adapter (every call, with static
    shapes: one program per kind)."""
    return ec.lora is not None and (ec.static_shapes or any(s.owner.lora for s in rows))


def _masks(plan: Plan, rows: list[Sequence], sample: np.ndarray, qs: np.ndarray, t: int,
           vocab_size: int, eos_ids: list[int]) -> np.ndarray:
    """Structured outputs: allowed-token bitmasks made on the host before the call is sent,
    one per row that samples under a constraint ([R, W]; all ones elsewhere), or in a verify
    step one per token ([T, W]): a constrained row's drafts each get the mask after the
    tokens before them."""
    if plan.drafts or plan.catchup:  # a verify call
        return grammar.fill_masks([(s.matcher, int(qs[i]), plan.drafts.get(id(s), []))
                                   for i, s in enumerate(rows) if s.matcher is not None], t,
                                  vocab_size, eos_ids)
    return grammar.fill_masks([(s.matcher, i, []) for i, s in enumerate(rows)
                               if s.matcher is not None and sample[i]], len(sample),
                              vocab_size, eos_ids)


def _step_buckets(chunks: list[tuple[Sequence, int]], num_rows: int, ec,
                  verify: bool = False) -> tuple[int, int]:
    """Rows R and tokens T of a ragged step (the module docstring's rules)."""
    top = next_pow2(ec.max_num_batched_tokens)
    if ec.static_shapes:
        return ec.max_num_seqs, max(top, next_pow2(ec.max_num_seqs))
    if verify and _drafting_model(ec):  # every row at k + 1 tokens: see _drafting_model
        r = next_pow2(num_rows)
        return r, r * (ec.speculative.k + 1)
    if verify:  # decodes and their drafts: compute-bound on a CPU, so pad a third at most
        return next_pow2(num_rows), next_half_octave(sum(n for _, n in chunks))
    if not any(n > 1 for _, n in chunks):  # decodes only: the window's buckets (from 1)
        r = next_pow2(num_rows)
        return r, r
    # With prefill chunks a step's cost is its T tokens; rows add little, and one row
    # bucket (all slots) means a server meets the same few programs at every load.
    r = next_pow2(ec.max_num_seqs)
    total = sum(n for _, n in chunks)
    t = next_half_octave(total, min(16, top))
    return r, top if t > top // 4 else t


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


def _drafting_model(ec) -> bool:
    """Whether verify calls run a draft model. Their shapes then depend on the row bucket
    alone (tokens R x (k + 1), max_q k + 1, every row long; catch-up in build_draft): how
    many drafts a row verifies (fewer before max_tokens, none while the draft catches up)
    and the draft's lag otherwise made combinations that a few prompts of warm-up need not
    meet, so programs were built mid-run (experiments.speculative_draft counted 4 in a timed
    cell). At the batch sizes a draft model runs at, a verify step reads the weights once
    whatever its T: the padding costs little."""
    return ec.speculative is not None and bool(ec.speculative.draft_model) \
        and not ec.static_shapes


def _step_shape(chunks, t: int, r: int, rows: list[Sequence], ec, backend: str,
                fixed_verify: bool = False) -> StepShape:
    # Queries per long row: the whole bucket, or an eighth of it when every chunk is short
    # (many small prefill chunks, e.g. after prefix-cache hits: the reference pads each row).
    longest = max(n for _, n in chunks)
    num_long = sum(1 for _, n in chunks if n > 1)
    if fixed_verify:  # as if every row verified k drafts (_drafting_model)
        longest, num_long = ec.speculative.k + 1, r
    # Only the backends whose cost follows these bounds get their buckets (the C++ kernel
    # walks each row's own queries): fewer programs for a server to build and hold.
    paged = backend in PAGED_COST_BACKENDS
    short = paged and longest <= t // 8
    max_q = 1 if not num_long else max(1, t // 8) if short else t
    long_rows = None if not num_long or backend != "reference" else \
        1 if num_long == 1 else 4 if num_long <= 4 else r
    if ec.static_shapes:
        max_q, long_rows = t, None
    pages = _pages(max(s.num_computed + n for s, n in chunks), ec) if paged else None
    return dataclasses.replace(
        step_shape(ec, max_q, _copies(chunks, ec, r), _flags(rows, ec), max_pages=pages),
        max_q_rows=min(long_rows, r) if long_rows else None)


def step_shape(ec, max_q: int, copies: int, flags: smp.SampleFlags, **pages) -> StepShape:
    """A step's StepShape from its bucketed bounds (warm-up builds the same ones:
    engine/warmup.py); `pages`: max_pages / decode_pages where the backend has them."""
    return StepShape(max_q=max_q, max_new_blocks=next_pow2(cdiv(max_q, ec.block_size) + 1),
                     max_copies=copies, flags=flags,
                     full_width=cdiv(max_q, ec.block_size) if ec.enable_prefix_caching else 0,
                     **pages)


def token_buckets(ec) -> list[int]:
    """Every T a step with prefill chunks can have (_step_buckets' rule, enumerated)."""
    top = next_pow2(ec.max_num_batched_tokens)
    out, t = [], next_half_octave(1, min(16, top))
    while t <= top // 4:
        out.append(t)
        t = next_half_octave(t + 1, min(16, top))
    return sorted(set(out) | {top})


def _pages(num_tokens: int, ec) -> int:
    return page_bucket(ec.max_model_len if ec.static_shapes else num_tokens, ec)


def build_window(
    plan: Plan, ec, backend: str
) -> tuple[np.ndarray, np.ndarray, StepShape, list[Sequence]]:
    """A decode window's rows: (row_slots [R], tokens [R], shape, rows)."""
    rows = [seq for seq, _ in plan.chunks]
    r = ec.max_num_seqs if ec.static_shapes else next_pow2(len(rows))
    w = ec.decode_window
    row_slots, tokens = np.full(r, -1, np.int32), np.zeros(r, np.int32)
    for i, seq in enumerate(rows):
        row_slots[i], tokens[i] = seq.slot, seq.tokens[-1]
    ends = [seq.num_computed + w for seq in rows]
    if ec.static_shapes:
        ends = [ec.max_model_len] * r
    flat = backend == "reference"
    shape = StepShape(
        max_q=1, max_copies=_copies(plan.chunks, ec, r),
        max_pages=_pages(max(ends), ec) if backend.startswith("pallas") else None,
        decode_pages=decode_page_bucket(ends, ec, r) if flat else None, flags=_flags(rows, ec),
        full_width=cdiv(w, ec.block_size) if ec.enable_prefix_caching else 0,
        lora=runs_adapters(rows, ec))
    return row_slots, tokens, shape, rows
