"""The data of one device call's step (engine/step.py runs it): its batch, admissions,
static shape and output. Apart from step.py so the draft model's code (engine/draft.py),
which step.py runs, can name them."""

from __future__ import annotations

import dataclasses

import jax

from paged_jax.cache.ops import KVOps
from paged_jax.sample import sampler as smp
from paged_jax.types import Array, Bool, Float, HostArray, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Admissions:
    """Slots going live at the start of a step, padded to A entries (slot -1).

    A slot goes live when a request is admitted for the first time, or resumes after a
    recompute preemption (swapped-out sequences come back through their own call first).

    Attributes:
      slot: [A] the slot; its page-table row is reset to empty.
      new_request: [A] first admission: write `sampling` into the slot's sampling row.
      sampling: [A] the requests' sampling parameters.
      prompt_mask: [A, V] prompt tokens (repetition penalty), only in steps whose flags have
        penalties; None otherwise.
      logit_bias: [A, V] the requests' bias rows, only in steps whose flags have bias.
      hit_blocks: [A, G, P] cached blocks of a prefix-cache hit per KV cache group, in
        logical order, 0-padded.
      hit_tokens: [A] tokens the hit covers (the slot starts with this length).
    """

    slot: Int[HostArray, "A"]
    new_request: Bool[HostArray, "A"]
    sampling: smp.SamplingRows
    prompt_mask: Bool[HostArray, "A V"] | None
    logit_bias: Float[HostArray, "A V"] | None
    hit_blocks: Int[HostArray, "A G P"]
    hit_tokens: Int[HostArray, "A"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One ragged step, padded to static shapes.

    Rows are the sequences taking part (prefill chunks first, then decodes, then the children
    of n > 1 forks, which have no tokens); row r owns tokens query_start[r] .. query_start[r+1]-1.

    Attributes:
      token_ids, positions: [T] input token and its position; padding past query_start[R].
      token_rows: [T] row of each token, -1 for padding.
      row_slots: [R] page-table slot of each row, -1 for padding rows.
      query_start: [R + 1] cumulative token offsets of the rows.
      sample: [R] rows that sample a token after this step (their prompt is complete).
      fork_src, fork_dst, fork_index: [F] rows: after the forward, the slot of row dst becomes
        a child of row src's slot (shares its blocks) and samples from its logits with key
        fold_in(key, index); src < 0 pads.
      admit: slots going live first (None: none; decode windows).
      ops: allocator ops applied before everything else (None: none).
      own: [R] rows the scheduler owns: settled by the device (see `settle`). Beam search's
        rows are not (it forks and frees them itself).
      next_ids: [T] for tokens of rows that want prompt logprobs, the prompt token after it
        (its logprob is reported); -1 elsewhere. Only in steps whose shape has prompt_top.
      masks: [R, W] each row's allowed-token bitmask (structured outputs, sample/grammar.py;
        all ones for unconstrained rows); a verify step's are per token, [T, W]. Only in
        steps whose flags have grammar.
    """

    token_ids: Int[HostArray, "T"]
    positions: Int[HostArray, "T"]
    token_rows: Int[HostArray, "T"]
    row_slots: Int[HostArray, "R"]
    query_start: Int[HostArray, "R+1"]
    sample: Bool[HostArray, "R"]
    fork_src: Int[HostArray, "F"]
    fork_dst: Int[HostArray, "F"]
    fork_index: Int[HostArray, "F"]
    admit: Admissions | None = None
    ops: KVOps | None = None
    own: Bool[HostArray, "R"] | None = None
    next_ids: Int[HostArray, "T"] | None = None
    masks: Int[HostArray, "_ W"] | None = None  # R (a step) or T (a verify step) rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOut:
    """Per-row results of a step (only rows with `sampled` set are meaningful), per-token
    prompt logprobs ([T], [T, J'] arrays when the shape has prompt_top, else empty), each
    row's last-token hidden state ([R, E] when the shape has `hidden`, else [R, 0]), and the
    cache report: `full_blocks` [R, G * F] the blocks that became full in the step, per KV
    cache group in logical order (0 pads; F = shape.full_width), and the pool's `refcount`
    after it ([N] with prefix caching, else [0])."""

    tokens: Int[Array, "R"]
    logprobs: Float[Array, "R"]
    top_ids: Int[Array, "R J"]
    top_logprobs: Float[Array, "R J"]
    sampled: Bool[Array, "R"]
    finished: Bool[Array, "R"]
    reason: Int[Array, "R"]
    ok: Bool[Array, ""]
    num_free: Int[Array, ""]
    prompt: smp.PromptLogprobs
    hidden: Float[Array, "R E"]
    full_blocks: Int[Array, "R GF"]
    refcount: Int[Array, "N2"]
    wire: Int[Array, "B"] | None = None  # every field above, packed (engine/wire.py)


@dataclasses.dataclass(frozen=True)
class StepShape:
    """Static bounds of one step, chosen by the host from buckets (part of the jit key).

    Attributes:
      max_q: tokens of any row (1: every row decodes).
      max_q_rows: only the first max_q_rows rows may have more than one token (None: any).
      max_new_blocks: blocks any slot gains in the step, copies included.
      max_copies: copy-on-write copies the step may make (rows whose last block may be
        shared); 0 skips the copy. A step that would need more is refused (ok False).
      max_pages: pages any row holds after the step (None: all P).
      decode_pages: pages of the single-token rows together (attention.flat_decode_reference).
      flags: sampler features the rows need.
      prompt_top: J', top logprobs per prompt token, when some row wants prompt logprobs
        (the forward then keeps every token's logits); None: none.
      hidden: return each row's last-token hidden state (some row finishing its prompt
        asked for it: SamplingParams.return_hidden_states).
      full_width: F, the most blocks a row can fill in the call (0: no report).
      verify: K + 1, the most tokens a row verifies (speculative decoding, engine/verify.py:
        every token's logits are kept and sampled); 0 for every other step.
      draft_q: with a draft model, the most catch-up tokens of any row (engine/draft.py).
      lora: some row runs a LoRA adapter: the forward adds the adapters' deltas.
    """

    max_q: int = 1
    max_q_rows: int | None = None
    max_new_blocks: int = 2
    max_copies: int = 0
    max_pages: int | None = None
    decode_pages: int | None = None
    flags: smp.SampleFlags = smp.SampleFlags()
    prompt_top: int | None = None
    hidden: bool = False
    full_width: int = 0
    verify: int = 0
    draft_q: int = 0
    lora: bool = False
