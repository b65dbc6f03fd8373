"""The pure, jittable sampler over per-sequence sampling state (sampling_state.py).

One row per sequence (S) and one column per vocabulary entry (V); J = top logprobs returned.

    raw logits [S, V] --log_softmax--> logprobs returned to the user (vLLM v1's default)
        |
        +-- min_tokens: EOS / stop ids -> -inf while num_generated < min_tokens
        +-- logit bias: logit_bias, allowed_token_ids, bad words (a per-slot [V] row)
        +-- penalties: repetition (prompt + output tokens), frequency, presence (output tokens)
        |--> greedy rows (temperature 0): argmax
        +-- / temperature, then min_p, top_k, top_p as one cut-off per row (one sort)
        '--> random rows: categorical draw with key fold_in(key[s], num_generated[s])

Determinism: row s draws with `fold_in(key[s], num_generated[s])` and its own logits only, so
a request's tokens do not depend on which slot it sits in or who shares the batch.

Cost. A step samples only the rows it runs (`rows_view` gathers their slots), and pays only
for the features some request in it asked for (`SampleFlags`, static): a greedy batch is an
argmax plus one log-sum-exp, with no sort, no random draw, no [S, V] history read or written.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels import cpu_matmul, cpu_rows
from paged_jax import compile_cache
from paged_jax.sample import grammar
from paged_jax.sample import logprobs as lp
from paged_jax.sample.state import (  # noqa: F401 (the state API, re-exported)
    KEY_IMPL,
    MAX_STOP_IDS,
    NO_LIMIT,
    SamplingRows,
    SamplingState,
    admit_rows,
    bias_row,
    fork_slot,
    fork_slots,
    init_sampling_state,
    rows_view,
    sampling_rows,
    seed_to_key_data,
    set_slot,
    update_rows,
    wrap_key,
)
from paged_jax.sampling_params import SamplingParams
from paged_jax.types import Array, Bool, Float, Int

FINISH_NONE, FINISH_LENGTH, FINISH_EOS, FINISH_STOP_TOKEN = 0, 1, 2, 3
"""Reasons returned by `stop_mask`: length -> "length"; EOS and stop ids -> "stop"."""


@dataclasses.dataclass(frozen=True)
class SampleFlags:
    """Which sampler features a step needs (static: part of the step's jit key).

    Attributes:
      random: some row has temperature > 0 (else every row is an argmax).
      filters: some row uses top_k / top_p / min_p (a sort of its row).
      penalties: some row uses a repetition / frequency / presence penalty; only then is the
        [S, V] history (prompt mask, output counts) read, reset at admission and updated.
      logprobs: some row wants its tokens' logprobs (a log-sum-exp over V per row); without
        it the returned logprobs are 0, as vLLM reports none (cumulative_logprob None).
      num_top_logprobs: J, top logprobs returned per row (0: none).
      bias: some row adds a logit bias row (logit_bias, allowed_token_ids, bad_words).
      grammar: some row's request has structured outputs: the step carries each row's
        allowed-token bitmask (sample/grammar.py), applied to the logits first (as vLLM:
        its logprobs are of the masked distribution too).
    """

    random: bool = True
    filters: bool = True
    penalties: bool = True
    logprobs: bool = True
    num_top_logprobs: int = 0
    bias: bool = True
    grammar: bool = False

    @classmethod
    def of(cls, params: list[SamplingParams], num_top_logprobs: int) -> SampleFlags:
        """The flags a step over requests with `params` needs (J when any asks logprobs)."""
        return cls(
            random=any(p.temperature > 0 for p in params),
            filters=any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0)
                        for p in params),
            penalties=any(p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                          or p.presence_penalty != 0.0 for p in params),
            logprobs=any(p.logprobs is not None for p in params),
            num_top_logprobs=num_top_logprobs if any(p.logprobs for p in params) else 0,
            bias=any(p.has_logit_bias for p in params),
            grammar=any(p.structured_outputs is not None for p in params))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleResult:
    """What `sample` returns for every row.

    Attributes:
      tokens: [S] sampled token ids.
      logprobs: [S] log-probability of the sampled token under the raw model distribution.
      ranks: [S] 1-based rank of the sampled token in that distribution.
      top_ids: [S, J] ids of the J most likely tokens (raw distribution), best first.
      top_logprobs: [S, J] their log-probabilities.
    """

    tokens: Int[Array, "S"]
    logprobs: Float[Array, "S"]
    ranks: Int[Array, "S"]
    top_ids: Int[Array, "S J"]
    top_logprobs: Float[Array, "S J"]


def apply_min_tokens(logits: Float[Array, "S V"], state: SamplingState) -> Float[Array, "S V"]:
    """Masks EOS (even with ignore_eos) and stop ids to -inf while num_generated < min_tokens:
    a scatter of S x 2M entries (into a copy of the logits where they are read again).

    Args:
      logits: [S, V] logits.
      state: the sampling state.

    Returns:
      [S, V] logits with the blocked tokens at -inf.
    """
    ids = blocked_ids(state)
    rows = jnp.arange(ids.shape[0])[:, None]
    # Unblocked entries go to column V, which mode="drop" discards.
    cols = jnp.where(ids >= 0, ids, logits.shape[1])
    return logits.at[rows, cols].set(-jnp.inf, mode="drop")


def blocked_ids(state: SamplingState) -> Int[Array, "S B"]:
    """Each row's ids that min_tokens blocks now (EOS and stop ids), -1 where none."""
    ids = jnp.concatenate([state.stop_ids, state.eos_ids], axis=1)
    return jnp.where((state.num_generated < state.min_tokens)[:, None], ids, -1)


def apply_penalties(logits: Float[Array, "S V"], state: SamplingState) -> Float[Array, "S V"]:
    """vLLM's penalties: repetition over prompt + output tokens, frequency and presence over output.

    Args:
      logits: [S, V] logits.
      state: the sampling state.

    Returns:
      [S, V] penalised logits (rows with default penalties are unchanged).
    """
    counts = state.output_counts
    seen = state.prompt_mask | (counts > 0)
    rep = state.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits -= state.frequency_penalty[:, None] * counts.astype(logits.dtype)
    return logits - state.presence_penalty[:, None] * (counts > 0).astype(logits.dtype)


def filter_logits(scaled: Float[Array, "S V"], state: SamplingState) -> Float[Array, "S V"]:
    """min_p, then top_k, then top_p (vLLM v1's order), as one per-row cut-off; one sort.

    Each filter keeps a prefix of the row sorted by descending logit, so together they keep
    the tokens whose logit reaches the cut-off value; ties at the cut-off are all kept.

    Args:
      scaled: [S, V] temperature-scaled logits.
      state: the sampling state.

    Returns:
      [S, V] logits with filtered tokens at -inf.
    """
    v = scaled.shape[1]
    desc = -jnp.sort(-scaled, axis=1)
    probs = jax.nn.softmax(desc, axis=1)
    rank = jnp.arange(v)[None, :]
    keep = probs >= state.min_p[:, None] * probs[:, :1]
    k = jnp.where(state.top_k > 0, state.top_k, v)[:, None]
    keep &= rank < k
    kept = jnp.where(keep, probs, 0.0)
    kept /= kept.sum(axis=1, keepdims=True)
    exclusive = jnp.cumsum(kept, axis=1) - kept
    # top_p = 1 is "off" outright: rounding can push the tail's cumulative mass to 1.0.
    keep &= (exclusive < state.top_p[:, None]) | (state.top_p[:, None] >= 1.0)
    keep = keep.at[:, 0].set(True)  # the top token always survives, whatever rounding does
    num_keep = keep.sum(axis=1)
    cutoff = jnp.take_along_axis(desc, (num_keep - 1)[:, None], axis=1)
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def _row_keys(state: SamplingState) -> jax.Array:
    return jax.vmap(lambda d, i: jax.random.fold_in(wrap_key(d), i))(state.key, state.num_generated)


def _draw(logits: Float[Array, "S V"], state: SamplingState, filters: bool = True
          ) -> Int[Array, "S"]:
    """Random rows' draw; greedy rows get a placeholder (temperature clamped to avoid inf)."""
    temp = jnp.maximum(state.temperature, 1e-5)[:, None]
    scaled = logits / temp
    if filters:
        # The sort is the step's costliest op; filter_logits is the identity when every filter
        # is off, so skipping it cannot change any row's draw (batch independence holds).
        needed = ((state.top_k > 0) | (state.top_p < 1.0) | (state.min_p > 0.0)).any()
        scaled = jax.lax.cond(needed, filter_logits, lambda x, _: x, scaled, state)
    return jax.vmap(jax.random.categorical)(_row_keys(state), scaled).astype(jnp.int32)


def first_argmax(x: Float[Array, "S V"]) -> Int[Array, "S"]:
    """Each row's argmax, ties to the lowest id (a row holding NaN: its first NaN), as
    jnp.argmax. On CPU the C++ row kernel (kernels/cpu_argmax.h): XLA:CPU's argmax reduces
    one row at a time without vectors (1.8 ms at 16 rows of a 49k vocabulary, 6.9 at 64)."""
    if _cpu_argmax():
        return cpu_rows.row_argmax(x)
    return jnp.argmax(x, axis=1).astype(jnp.int32)


@functools.cache
def _cpu_argmax() -> bool:
    """Whether this process runs on CPU with the C++ kernels built (decided once)."""
    return jax.default_backend() == "cpu" and cpu_matmul.load(str(compile_cache.kernel_folder()))


def sample(
    logits: Float[Array, "S V"], state: SamplingState, num_top_logprobs: int = 0,
    flags: SampleFlags | None = None, masks: Int[Array, "S W"] | None = None,
    active: Bool[Array, "S"] | None = None,
) -> SampleResult:
    """Samples one token per row from RAW model logits under each row's parameters.

    Applies min_tokens masking and penalties itself (so pass unprocessed logits). Greedy rows
    (temperature 0) take the argmax of the penalised logits, ties to the lowest id.

    Returned logprobs follow vLLM v1's default: log_softmax of the raw logits, before
    penalties, temperature and filtering.

    Args:
      logits: [S, V] raw model logits of each row's last position.
      state: the sampling state (or a `rows_view` of it).
      num_top_logprobs: J (static), how many top logprobs to return per row; the host slices
        each request's own `SamplingParams.logprobs` out of it. Ignored when flags are given.
      flags: static features the rows need; None = all (any row may use any feature).
      masks: [S, W] allowed-token bitmasks (sample/grammar.py), read when flags.grammar.
      active: [S] the rows whose tokens are kept (None: all): on CPU logprobs are computed
        for these rows only (`with_logprobs`).

    Returns:
      SampleResult with tokens [S], logprobs [S], ranks [S], top_ids / top_logprobs [S, J].
    """
    flags = flags or SampleFlags(num_top_logprobs=num_top_logprobs)
    logits = constrained(logits, flags, masks)
    if _cpu_argmax() and not (flags.random or flags.bias or flags.penalties):
        # the kernel skips min_tokens' blocked ids: writing them copied [S, V] (64 rows of a
        # 152k vocabulary: a short request 10% slower, page faults of the fresh 39 MB)
        tokens = cpu_rows.row_argmax(logits.astype(jnp.float32), blocked=blocked_ids(state))
    else:
        tokens = _tokens(logits, state, flags)
    if not (flags.logprobs or flags.num_top_logprobs):
        zf, zi = jnp.zeros(tokens.shape, jnp.float32), jnp.zeros(tokens.shape, jnp.int32)
        s = tokens.shape[0]
        return SampleResult(tokens, zf, zi, jnp.zeros((s, 0), jnp.int32),
                            jnp.zeros((s, 0), jnp.float32))
    return with_logprobs(logits, tokens, flags, active)


def _tokens(logits: Float[Array, "S V"], state: SamplingState,
            flags: SampleFlags) -> Int[Array, "S"]:
    """Each row's token from its processed logits: the argmax, or a draw for random rows."""
    processed = _processed(logits, state, flags)
    greedy = first_argmax(processed)
    if not flags.random:
        return greedy
    is_greedy = state.temperature == 0.0
    # Drawing costs a random number per vocab entry per row; all-greedy batches skip it.
    draw = functools.partial(_draw, filters=flags.filters)
    drawn = jax.lax.cond(is_greedy.all(), lambda *_: greedy, draw, processed, state)
    return jnp.where(is_greedy, greedy, drawn)


def with_logprobs(logits: Float[Array, "S V"], tokens: Int[Array, "S"],
                  flags: SampleFlags, active: Bool[Array, "S"] | None = None) -> SampleResult:
    """`tokens` with their raw logprobs, ranks and the top J (what `sample` reports); with
    `active` on CPU, for those rows only (the others: zeros), by the C++ kernel if built."""
    if active is not None and _cpu_argmax():  # the C++ row kernel (kernels/cpu_logprobs.h)
        found = cpu_rows.row_logprobs(logits, tokens, active, flags.num_top_logprobs)
    elif active is not None and jax.default_backend() == "cpu":
        found = lp.gather_active(logits, tokens, flags.num_top_logprobs, active)
    else:
        found = lp.gather(logits, tokens, flags.num_top_logprobs)
    return SampleResult(tokens, *found)


def constrained(logits: Float[Array, "S V"], flags: SampleFlags,
                masks: Int[Array, "S W"] | None) -> Float[Array, "S V"]:
    """The logits under the rows' structured-output masks (as they are without the flag)."""
    if not flags.grammar:
        return logits
    if masks is None:
        raise ValueError("a step whose flags have grammar needs its rows' masks")
    return grammar.apply_mask(logits, masks)


def _processed(logits: Float[Array, "S V"], state: SamplingState,
               flags: SampleFlags) -> Float[Array, "S V"]:
    """Raw logits after min_tokens, logit bias and penalties (before temperature)."""
    processed = apply_min_tokens(logits.astype(jnp.float32), state)
    if flags.bias:
        processed = jnp.where(state.has_bias[:, None], processed + state.logit_bias, processed)
    if flags.penalties:
        processed = apply_penalties(processed, state)
    return processed


def distribution(logits: Float[Array, "S V"], state: SamplingState,
                 flags: SampleFlags) -> Float[Array, "S V"]:
    """The probabilities `sample` draws each row's token from: one-hot at the argmax for
    greedy rows, else the softmax of the processed logits over temperature, filtered
    (speculative decoding's p and q must be the distributions the tokens come from)."""
    processed = _processed(logits, state, flags)
    v = processed.shape[1]
    one_hot = jax.nn.one_hot(first_argmax(processed), v, dtype=jnp.float32)
    if not flags.random:
        return one_hot
    scaled = processed / jnp.maximum(state.temperature, 1e-5)[:, None]
    if flags.filters:
        scaled = filter_logits(scaled, state)
    probs = jax.nn.softmax(scaled, axis=1)
    return jnp.where((state.temperature == 0.0)[:, None], one_hot, probs)


def draw_from(probs: Float[Array, "S V"], state: SamplingState, salt: int) -> Int[Array, "S"]:
    """A token per row from `probs` with key fold_in(fold_in(key, num_generated), salt): a
    stream of its own beside the row's sampling key (one-hot rows give their token)."""
    keys = jax.vmap(lambda k: jax.random.fold_in(k, salt))(_row_keys(state))
    logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)
    return jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)


def uniform(state: SamplingState, salt: int) -> Float[Array, "S"]:
    """A U[0, 1) number per row from its key stream `salt` (speculative acceptance)."""
    keys = jax.vmap(lambda k: jax.random.fold_in(k, salt))(_row_keys(state))
    return jax.vmap(jax.random.uniform)(keys)


def stop_mask(
    state: SamplingState, tokens: Int[Array, "S"]
) -> tuple[Bool[Array, "S"], Int[Array, "S"]]:
    """Which rows stop after `tokens`, checked as vLLM does: length, then EOS, then stop ids.

    Call it with the state returned by `update_rows`, so num_generated counts
    `tokens`. EOS and stop ids only stop a row once num_generated >= min_tokens; AND the
    result with the active mask (idle rows may report a stop).

    Args:
      state: the sampling state after counting `tokens`.
      tokens: [S] the tokens just sampled.

    Returns:
      (finished [S], reason [S]) with reason one of FINISH_NONE, FINISH_LENGTH, FINISH_EOS,
      FINISH_STOP_TOKEN. For FINISH_STOP_TOKEN the stop_reason is the token itself.
    """
    length = state.num_generated >= state.max_tokens
    may_stop = state.num_generated >= state.min_tokens
    hit = lambda ids: ((tokens[:, None] == ids) & (ids >= 0)).any(axis=1)  # noqa: E731
    eos = hit(state.eos_ids) & ~state.ignore_eos & may_stop
    stop_id = hit(state.stop_ids) & may_stop
    reason = jnp.where(
        length, FINISH_LENGTH,
        jnp.where(eos, FINISH_EOS, jnp.where(stop_id, FINISH_STOP_TOKEN, FINISH_NONE)),
    ).astype(jnp.int32)
    return reason != FINISH_NONE, reason


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Per-token logprob of the next prompt token (`StepBatch.next_ids`), its rank in the
    vocabulary, and the top J' alternatives; raw model logprobs, as vLLM reports them."""

    logprobs: Float[Array, "T"]
    ranks: Int[Array, "T"]
    top_ids: Int[Array, "T J"]
    top_logprobs: Float[Array, "T J"]

    @classmethod
    def empty(cls, t: int = 0, j: int = 0) -> PromptLogprobs:
        return cls(jnp.zeros((t,), jnp.float32), jnp.zeros((t,), jnp.int32),
                   jnp.zeros((t, j), jnp.int32), jnp.zeros((t, j), jnp.float32))


def prompt_logprobs(
    logits: Float[Array, "T V"], next_ids: Int[Array, "T"], top: int
) -> PromptLogprobs:
    """Logprob and rank of each token's next prompt token, and the top `top` per token."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    want = jnp.take_along_axis(lp, jnp.clip(next_ids, 0)[:, None], axis=-1)[:, 0]
    ranks = 1 + (lp > want[:, None]).sum(-1, dtype=jnp.int32)
    top_lp, top_ids = jax.lax.top_k(lp, top)
    return PromptLogprobs(want, ranks, top_ids.astype(jnp.int32), top_lp)
