"""Per-sequence sampling state as arrays, and the pure, jittable sampler that reads it.

One row per sequence slot (S) and one column per vocabulary entry (V). Extra axis letters:
M = padded width of the stop-token / EOS id lists (-1 = padding), J = top logprobs returned,
A = admitted requests, B = rows of a step.

    raw logits [S, V] --log_softmax--> logprobs returned to the user (vLLM v1's default)
        |
        +-- min_tokens: EOS / stop ids -> -inf while num_generated < min_tokens
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
import numpy as np
from jaxtyping import UInt

from paged_jax.sampling_params import SamplingParams
from paged_jax.types import Array, Bool, Float, Int

KEY_IMPL = "threefry2x32"
"""Keys are stored as raw threefry data, [S, 2] uint32, so the state is a plain-array pytree."""

MAX_STOP_IDS = 8
"""M: the most stop token ids (and EOS ids) one request may carry."""

NO_LIMIT = 2**30
"""max_tokens of a request that set none: the engine stops it at the model's context length."""

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
    """

    random: bool = True
    filters: bool = True
    penalties: bool = True
    logprobs: bool = True
    num_top_logprobs: int = 0

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
            num_top_logprobs=num_top_logprobs if any(p.logprobs for p in params) else 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingState:
    """Sampling parameters and history of `S` sequence slots over a vocabulary of `V`.

    Attributes:
      temperature: [S] 0 = greedy.
      top_k: [S] 0 = off.
      top_p: [S] 1 = off.
      min_p: [S] 0 = off.
      presence_penalty: [S] 0 = off.
      frequency_penalty: [S] 0 = off.
      repetition_penalty: [S] 1 = off.
      key: [S, 2] threefry key data of each slot.
      prompt_mask: [S, V] tokens present in the prompt (for the repetition penalty).
      output_counts: [S, V] how often each token was generated.
      num_generated: [S] tokens generated so far.
      min_tokens: [S] EOS / stop ids blocked while num_generated < min_tokens.
      max_tokens: [S] stop once num_generated reaches it.
      ignore_eos: [S] EOS does not stop the sequence.
      stop_ids: [S, M] stop token ids, -1 padded.
      eos_ids: [S, M] EOS token ids, -1 padded.
    """

    temperature: Float[Array, "S"]
    top_k: Int[Array, "S"]
    top_p: Float[Array, "S"]
    min_p: Float[Array, "S"]
    presence_penalty: Float[Array, "S"]
    frequency_penalty: Float[Array, "S"]
    repetition_penalty: Float[Array, "S"]
    key: UInt[Array, "S 2"]
    prompt_mask: Bool[Array, "S V"]
    output_counts: Int[Array, "S V"]
    num_generated: Int[Array, "S"]
    min_tokens: Int[Array, "S"]
    max_tokens: Int[Array, "S"]
    ignore_eos: Bool[Array, "S"]
    stop_ids: Int[Array, "S M"]
    eos_ids: Int[Array, "S M"]

    @property
    def max_seqs(self) -> int:
        return self.temperature.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.prompt_mask.shape[1]


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


def init_sampling_state(
    max_seqs: int, vocab_size: int, max_stop_ids: int = MAX_STOP_IDS
) -> SamplingState:
    """A state of `max_seqs` idle slots: greedy, no penalties, no stop ids.

    Args:
      max_seqs: S, the number of sequence slots.
      vocab_size: V.
      max_stop_ids: M, the most stop token ids (and EOS ids) one request may carry.

    Returns:
      The state.
    """
    s, v, m = max_seqs, vocab_size, max_stop_ids
    f = lambda x: jnp.full((s,), x, jnp.float32)  # noqa: E731
    i = lambda x: jnp.full((s,), x, jnp.int32)  # noqa: E731
    return SamplingState(
        temperature=f(0.0), top_k=i(0), top_p=f(1.0), min_p=f(0.0),
        presence_penalty=f(0.0), frequency_penalty=f(0.0), repetition_penalty=f(1.0),
        key=jnp.zeros((s, 2), jnp.uint32),
        prompt_mask=jnp.zeros((s, v), bool), output_counts=jnp.zeros((s, v), jnp.int32),
        num_generated=i(0), min_tokens=i(0), max_tokens=i(NO_LIMIT),
        ignore_eos=jnp.zeros((s,), bool),
        stop_ids=jnp.full((s, m), -1, jnp.int32), eos_ids=jnp.full((s, m), -1, jnp.int32),
    )


PARAM_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "key", "min_tokens", "max_tokens",
                "ignore_eos", "stop_ids", "eos_ids")
"""The per-request fields of SamplingState, written at admission (the rest is history)."""
HISTORY_FIELDS = ("prompt_mask", "output_counts")


def rows_view(state: SamplingState, slots: Int[Array, "B"], history: bool) -> SamplingState:
    """The state of the slots a step runs, one row each (slot < 0: a padding row).

    Without `history` the [S, V] arrays are not gathered (their view is [B, 0]): only
    penalties read them.
    """
    s = jnp.clip(slots, 0)
    rows = {f.name: getattr(state, f.name)[s] for f in dataclasses.fields(state)
            if history or f.name not in HISTORY_FIELDS}
    for name in HISTORY_FIELDS if not history else ():
        rows[name] = jnp.zeros((slots.shape[0], 0), getattr(state, name).dtype)
    return SamplingState(**rows)


def update_rows(
    state: SamplingState, slots: Int[Array, "B"], tokens: Int[Array, "B"],
    active: Bool[Array, "B"], history: bool,
) -> SamplingState:
    """`update_after_sample` for rows of slots (padding slots < 0 are dropped)."""
    dest = jnp.where(active & (slots >= 0), slots, state.max_seqs)
    out = dataclasses.replace(
        state, num_generated=state.num_generated.at[dest].add(1, mode="drop"))
    if history:
        counts = state.output_counts.at[dest, tokens].add(1, mode="drop")
        out = dataclasses.replace(out, output_counts=counts)
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-request parameters of A admitted requests (the PARAM_FIELDS of SamplingState)."""

    temperature: Float[Array, "A"]
    top_k: Int[Array, "A"]
    top_p: Float[Array, "A"]
    min_p: Float[Array, "A"]
    presence_penalty: Float[Array, "A"]
    frequency_penalty: Float[Array, "A"]
    repetition_penalty: Float[Array, "A"]
    key: UInt[Array, "A 2"]
    min_tokens: Int[Array, "A"]
    max_tokens: Int[Array, "A"]
    ignore_eos: Bool[Array, "A"]
    stop_ids: Int[Array, "A M"]
    eos_ids: Int[Array, "A M"]


def sampling_rows(
    items: list[tuple[SamplingParams, list[int], int]], width: int, max_stop_ids: int
) -> SamplingRows:
    """Rows for `items` = [(params, eos_token_ids, seed)] padded to `width`, built on the host.

    The seed is used when `params.seed` is None (the engine passes its seed + a counter).
    """
    a, m = width, max_stop_ids
    cols: dict[str, np.ndarray] = dict(
        temperature=np.zeros(a, np.float32), top_k=np.zeros(a, np.int32),
        top_p=np.ones(a, np.float32), min_p=np.zeros(a, np.float32),
        presence_penalty=np.zeros(a, np.float32), frequency_penalty=np.zeros(a, np.float32),
        repetition_penalty=np.ones(a, np.float32), key=np.zeros((a, 2), np.uint32),
        min_tokens=np.zeros(a, np.int32), max_tokens=np.full(a, NO_LIMIT, np.int32),
        ignore_eos=np.zeros(a, bool), stop_ids=np.full((a, m), -1, np.int32),
        eos_ids=np.full((a, m), -1, np.int32))
    for i, (p, eos, seed) in enumerate(items):
        for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos"):
            cols[name][i] = getattr(p, name)
        cols["key"][i] = seed_to_key_data(p.seed if p.seed is not None else seed)
        cols["max_tokens"][i] = NO_LIMIT if p.max_tokens is None else p.max_tokens
        cols["stop_ids"][i] = _padded_ids(list(p.stop_token_ids or []), m, "stop_token_ids")
        cols["eos_ids"][i] = _padded_ids(list(eos), m, "eos_token_ids")
    return SamplingRows(**jax.device_put(cols))  # one transfer for every field


def admit_rows(
    state: SamplingState, slots: Int[Array, "A"], rows: SamplingRows,
    prompt_mask: Bool[Array, "A V"] | None = None,
) -> SamplingState:
    """Writes admitted requests into their slots (slot < 0: padding); jittable.

    Resets num_generated. With `prompt_mask` (a step whose flags have penalties) the history
    rows are reset too: the prompt's tokens marked, output counts zeroed. Without it they keep
    a former occupant's values, which only penalties read, and a request with default
    penalties is unaffected by them.
    """
    dest = jnp.where(slots >= 0, slots, state.max_seqs)
    put = lambda a, x: a.at[dest].set(jnp.asarray(x, a.dtype), mode="drop")  # noqa: E731
    out = {name: put(getattr(state, name), getattr(rows, name)) for name in PARAM_FIELDS}
    out["num_generated"] = put(state.num_generated, 0)
    if prompt_mask is not None:
        out["prompt_mask"] = put(state.prompt_mask, prompt_mask)
        out["output_counts"] = put(state.output_counts, 0)
    return dataclasses.replace(state, **out)


def seed_to_key_data(seed: int) -> np.ndarray:
    """Threefry key data of an integer seed; equals `key_data(PRNGKey(seed))` for 0 <= seed < 2**31.

    Args:
      seed: any Python int (taken modulo 2**64, so vLLM's arbitrary seeds are accepted).

    Returns:
      [2] uint32 (high word, low word).
    """
    seed &= (1 << 64) - 1
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def _padded_ids(ids: list[int], width: int, what: str) -> np.ndarray:
    if len(ids) > width:
        raise ValueError(f"{what}: {len(ids)} ids exceed the state's max_stop_ids={width}.")
    out = np.full((width,), -1, np.int32)
    out[: len(ids)] = ids
    return out


def set_slot(
    state: SamplingState,
    slot: int,
    params: SamplingParams,
    prompt_token_ids: list[int],
    eos_token_ids: list[int],
    seed: int,
) -> SamplingState:
    """Writes a newly admitted request into `slot` (host-side; resets its history).

    Args:
      state: the sampling state.
      slot: the sequence slot the request occupies.
      params: its sampling parameters.
      prompt_token_ids: its prompt (marks the tokens the repetition penalty applies to).
      eos_token_ids: the model's EOS ids (at most M).
      seed: used when `params.seed` is None; the engine passes e.g. its seed + request counter.

    Returns:
      The state with row `slot` replaced.
    """
    rows = sampling_rows([(params, list(eos_token_ids), seed)], 1, state.stop_ids.shape[1])
    prompt = np.zeros((1, state.vocab_size), bool)
    prompt[0, np.asarray(prompt_token_ids, np.int64)] = True
    return admit_rows(state, jnp.asarray([slot], jnp.int32), rows, jnp.asarray(prompt))


def fork_slot(
    state: SamplingState,
    src: int | Int[Array, ""],
    dst: int | Int[Array, ""],
    sample_index: int | Int[Array, ""],
) -> SamplingState:
    """Copies row `src` into row `dst` for parallel sampling (n > 1); jittable.

    Args:
      state: the sampling state.
      src: the parent's slot.
      dst: the child's slot.
      sample_index: the child's output index (1 .. n-1); its key is fold_in(parent key, index),
        so the n outputs differ yet are reproducible from the request's seed.

    Returns:
      The state with row `dst` a copy of row `src` under its own key.
    """
    one = lambda x: jnp.asarray(x, jnp.int32).reshape(1)  # noqa: E731
    return fork_slots(state, one(src), one(dst), one(sample_index))


def fork_slots(
    state: SamplingState, src: Int[Array, "F"], dst: Int[Array, "F"], index: Int[Array, "F"]
) -> SamplingState:
    """`fork_slot` for F pairs at once (the engine step's forks); pairs with src < 0 pad.

    Returns:
      The state with each row dst[f] a copy of row src[f] under key fold_in(key, index[f]).
    """
    dst = jnp.where(src >= 0, dst, state.max_seqs)  # index S is dropped
    src = jnp.clip(src, 0)
    copied = jax.tree.map(lambda a: a.at[dst].set(a[src], mode="drop"), state)
    keys = jax.vmap(lambda k, i: jax.random.key_data(jax.random.fold_in(_wrap(k), i)))(
        state.key[src], index)
    return dataclasses.replace(copied, key=copied.key.at[dst].set(keys, mode="drop"))


def _wrap(key_data: UInt[Array, "2"]) -> jax.Array:
    return jax.random.wrap_key_data(key_data, impl=KEY_IMPL)


def apply_min_tokens(logits: Float[Array, "S V"], state: SamplingState) -> Float[Array, "S V"]:
    """Masks EOS (even with ignore_eos) and stop ids to -inf while num_generated < min_tokens.

    A scatter of S x 2M entries, not an [S, V] mask: cheap enough to run in every step.

    Args:
      logits: [S, V] logits.
      state: the sampling state.

    Returns:
      [S, V] logits with the blocked tokens at -inf.
    """
    ids = jnp.concatenate([state.stop_ids, state.eos_ids], axis=1)
    blocked = (ids >= 0) & (state.num_generated < state.min_tokens)[:, None]
    rows = jnp.arange(ids.shape[0])[:, None]
    # Unblocked entries go to column V, which mode="drop" discards.
    cols = jnp.where(blocked, ids, logits.shape[1])
    return logits.at[rows, cols].set(-jnp.inf, mode="drop")


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
    return jax.vmap(lambda d, i: jax.random.fold_in(_wrap(d), i))(state.key, state.num_generated)


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


def _gather_logprobs(
    raw: Float[Array, "S V"], tokens: Int[Array, "S"], num_top: int
) -> tuple[Float[Array, "S"], Int[Array, "S"], Int[Array, "S J"], Float[Array, "S J"]]:
    raw = raw.astype(jnp.float32)
    # log_softmax(raw)[token], rounded as log_softmax rounds, without an [S, V] result.
    mx = jax.lax.stop_gradient(raw.max(axis=1, keepdims=True))
    log_norm = jnp.log(jnp.exp(raw - mx).sum(axis=1, keepdims=True))
    picked = jnp.take_along_axis(raw, tokens[:, None], axis=1)
    chosen = ((picked - mx) - log_norm)[:, 0]
    ranks = (raw > picked).sum(axis=1).astype(jnp.int32) + 1
    if not num_top:
        s = raw.shape[0]
        return chosen, ranks, jnp.zeros((s, 0), jnp.int32), jnp.zeros((s, 0), jnp.float32)
    top_raw, top_ids = jax.lax.top_k(raw, num_top)
    return chosen, ranks, top_ids.astype(jnp.int32), (top_raw - mx) - log_norm


def sample(
    logits: Float[Array, "S V"], state: SamplingState, num_top_logprobs: int = 0,
    flags: SampleFlags | None = None,
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

    Returns:
      SampleResult with tokens [S], logprobs [S], ranks [S], top_ids / top_logprobs [S, J].
    """
    flags = flags or SampleFlags(num_top_logprobs=num_top_logprobs)
    processed = apply_min_tokens(logits.astype(jnp.float32), state)
    if flags.penalties:
        processed = apply_penalties(processed, state)
    greedy = jnp.argmax(processed, axis=1).astype(jnp.int32)
    tokens = greedy
    if flags.random:
        is_greedy = state.temperature == 0.0
        # Drawing costs a random number per vocab entry per row; all-greedy batches skip it.
        draw = functools.partial(_draw, filters=flags.filters)
        drawn = jax.lax.cond(is_greedy.all(), lambda *_: greedy, draw, processed, state)
        tokens = jnp.where(is_greedy, greedy, drawn)
    if not (flags.logprobs or flags.num_top_logprobs):
        zf, zi = jnp.zeros(tokens.shape, jnp.float32), jnp.zeros(tokens.shape, jnp.int32)
        s = tokens.shape[0]
        return SampleResult(tokens, zf, zi, jnp.zeros((s, 0), jnp.int32),
                            jnp.zeros((s, 0), jnp.float32))
    chosen, ranks, top_ids, top_lp = _gather_logprobs(logits, tokens, flags.num_top_logprobs)
    return SampleResult(tokens, chosen, ranks, top_ids, top_lp)


def update_after_sample(
    state: SamplingState, tokens: Int[Array, "S"], active: Bool[Array, "S"]
) -> SamplingState:
    """Counts the sampled tokens of active rows (output counts and num_generated).

    Args:
      state: the sampling state.
      tokens: [S] the tokens just sampled.
      active: [S] rows whose token is real (padding / prefill-in-progress rows are not).

    Returns:
      The state with counts and num_generated advanced for active rows.
    """
    rows = jnp.arange(state.max_seqs)
    counts = state.output_counts.at[rows, tokens].add(active.astype(jnp.int32))
    num_generated = state.num_generated + active.astype(jnp.int32)
    return dataclasses.replace(state, output_counts=counts, num_generated=num_generated)


def stop_mask(
    state: SamplingState, tokens: Int[Array, "S"]
) -> tuple[Bool[Array, "S"], Int[Array, "S"]]:
    """Which rows stop after `tokens`, checked as vLLM does: length, then EOS, then stop ids.

    Call it with the state returned by `update_after_sample`, so num_generated counts
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
