"""Per-sequence sampling state as arrays: what each slot's request asked for, and its history.

One row per sequence slot (S) and one column per vocabulary entry (V); M = padded width of the
stop-token / EOS id lists (-1 = padding), A = admitted requests, B = rows of a step.

    admission   sampling_rows (host) -> admit_rows: a request's parameters into its slot
    a step      rows_view: the rows it runs (history [S, V] only when penalties need it)
                update_rows: counts of the sampled tokens
    n > 1       fork_slots: a child copies its parent's row under key fold_in(key, index)

The sampler that reads this state is sampling.py.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import UInt

from paged_jax.sampling_params import SamplingParams
from paged_jax.types import Array, Bool, Float, HostArray, Int

KEY_IMPL = "threefry2x32"
"""Keys are stored as raw threefry data, [S, 2] uint32, so the state is a plain-array pytree."""

MAX_STOP_IDS = 8
"""M: the most stop token ids (and EOS ids) one request may carry."""

NO_LIMIT = 2**30
"""max_tokens of a request that set none: the engine stops it at the model's context length."""

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
      last_token: [S] the token sampled last (async scheduling feeds it to the next step
        on the device: the host learns it one step later).
      min_tokens: [S] EOS / stop ids blocked while num_generated < min_tokens.
      max_tokens: [S] stop once num_generated reaches it.
      ignore_eos: [S] EOS does not stop the sequence.
      stop_ids: [S, M] stop token ids, -1 padded.
      eos_ids: [S, M] EOS token ids, -1 padded.
      has_bias: [S] the slot's request adds `logit_bias` (else its row is stale: unread).
      logit_bias: [S, V] added to the logits (-inf: never sampled); see `bias_row`.
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
    last_token: Int[Array, "S"]
    min_tokens: Int[Array, "S"]
    max_tokens: Int[Array, "S"]
    ignore_eos: Bool[Array, "S"]
    stop_ids: Int[Array, "S M"]
    eos_ids: Int[Array, "S M"]
    has_bias: Bool[Array, "S"]
    # "_V": unchecked, since a step's view may hold the bias rows but not the history (V = 0).
    logit_bias: Float[Array, "S _V"]

    @property
    def max_seqs(self) -> int:
        return self.temperature.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.prompt_mask.shape[1]


@functools.partial(jax.jit, static_argnums=(0, 1, 2))  # one program, not 16 eager fills
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
        num_generated=i(0), last_token=i(0), min_tokens=i(0), max_tokens=i(NO_LIMIT),
        ignore_eos=jnp.zeros((s,), bool),
        stop_ids=jnp.full((s, m), -1, jnp.int32), eos_ids=jnp.full((s, m), -1, jnp.int32),
        has_bias=jnp.zeros((s,), bool), logit_bias=jnp.zeros((s, v), jnp.float32),
    )


PARAM_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "key", "min_tokens", "max_tokens",
                "ignore_eos", "stop_ids", "eos_ids", "has_bias")
"""The per-request fields of SamplingState, written at admission (the rest is history)."""
HISTORY_FIELDS = ("prompt_mask", "output_counts")
BIAS_FIELDS = ("logit_bias",)


def rows_view(
    state: SamplingState, slots: Int[Array, "B"], history: bool, bias: bool = False
) -> SamplingState:
    """The state of the slots a step runs, one row each (slot < 0: a padding row).

    The [S, V] arrays are gathered only when asked (else their view is [B, 0]): `history`
    for penalties, `bias` for logit biases.
    """
    s = jnp.clip(slots, 0)
    skip = (() if history else HISTORY_FIELDS) + (() if bias else BIAS_FIELDS)
    rows = {f.name: getattr(state, f.name)[s] for f in dataclasses.fields(state)
            if f.name not in skip}
    for name in skip:
        rows[name] = jnp.zeros((slots.shape[0], 0), getattr(state, name).dtype)
    return SamplingState(**rows)


def update_rows(
    state: SamplingState, slots: Int[Array, "B"], tokens: Int[Array, "B"],
    active: Bool[Array, "B"], history: bool,
) -> SamplingState:
    """Counts the tokens sampled for rows of slots: num_generated, the last token, and the
    output counts when `history` (penalties read them). Inactive rows and padding slots (< 0)
    are dropped."""
    dest = jnp.where(active & (slots >= 0), slots, state.max_seqs)
    out = dataclasses.replace(
        state, num_generated=state.num_generated.at[dest].add(1, mode="drop"),
        last_token=state.last_token.at[dest].set(tokens, mode="drop"))
    if history:
        counts = state.output_counts.at[dest, tokens].add(1, mode="drop")
        out = dataclasses.replace(out, output_counts=counts)
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-request parameters of A admitted requests (the PARAM_FIELDS of SamplingState)."""

    temperature: Float[HostArray, "A"]
    top_k: Int[HostArray, "A"]
    top_p: Float[HostArray, "A"]
    min_p: Float[HostArray, "A"]
    presence_penalty: Float[HostArray, "A"]
    frequency_penalty: Float[HostArray, "A"]
    repetition_penalty: Float[HostArray, "A"]
    key: UInt[HostArray, "A 2"]
    min_tokens: Int[HostArray, "A"]
    max_tokens: Int[HostArray, "A"]
    ignore_eos: Bool[HostArray, "A"]
    stop_ids: Int[HostArray, "A M"]
    eos_ids: Int[HostArray, "A M"]
    has_bias: Bool[HostArray, "A"]


def bias_row(params: SamplingParams, vocab_size: int, banned: Sequence[int] = ()) -> np.ndarray:
    """[V] the logit bias of one request: -inf outside allowed_token_ids and at banned ids
    (its bad words, tokenized by the engine), plus its logit_bias values."""
    row = np.zeros(vocab_size, np.float32)
    if params.allowed_token_ids:
        row[:] = -np.inf
        row[np.asarray(params.allowed_token_ids, np.int64)] = 0.0
    for t, b in (params.logit_bias or {}).items():
        row[t] += b
    row[np.asarray(list(banned), np.int64)] = -np.inf
    return row


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
        eos_ids=np.full((a, m), -1, np.int32), has_bias=np.zeros(a, bool))
    for i, (p, eos, seed) in enumerate(items):
        for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos"):
            cols[name][i] = getattr(p, name)
        cols["key"][i] = seed_to_key_data(p.seed if p.seed is not None else seed)
        cols["max_tokens"][i] = NO_LIMIT if p.max_tokens is None else p.max_tokens
        cols["stop_ids"][i] = _padded_ids(list(p.stop_token_ids or []), m, "stop_token_ids")
        cols["eos_ids"][i] = _padded_ids(list(eos), m, "eos_token_ids")
        cols["has_bias"][i] = p.has_logit_bias
    return SamplingRows(**cols)  # numpy: the jitted call copies them in


def admit_rows(
    state: SamplingState, slots: Int[Array, "A"], rows: SamplingRows,
    prompt_mask: Bool[Array, "A V"] | None = None,
    logit_bias: Float[Array, "A V"] | None = None,
) -> SamplingState:
    """Writes admitted requests into their slots (slot < 0: padding); jittable.

    Resets num_generated. With `prompt_mask` (a step whose flags have penalties) the history
    rows are reset too: the prompt's tokens marked, output counts zeroed. Without it they keep
    a former occupant's values, which only penalties read, and a request with default
    penalties is unaffected by them. `logit_bias` (a step whose flags have bias) writes the
    bias rows; a slot's row is read only while its `has_bias` is set.
    """
    dest = jnp.where(slots >= 0, slots, state.max_seqs)
    put = lambda a, x: a.at[dest].set(jnp.asarray(x, a.dtype), mode="drop")  # noqa: E731
    out = {name: put(getattr(state, name), getattr(rows, name)) for name in PARAM_FIELDS}
    out["num_generated"] = put(state.num_generated, 0)
    if prompt_mask is not None:
        out["prompt_mask"] = put(state.prompt_mask, prompt_mask)
        out["output_counts"] = put(state.output_counts, 0)
    if logit_bias is not None:
        out["logit_bias"] = put(state.logit_bias, logit_bias)
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
    banned: Sequence[int] = (),
) -> SamplingState:
    """Writes a newly admitted request into `slot` (host-side; resets its history).

    Args:
      state: the sampling state.
      slot: the sequence slot the request occupies.
      params: its sampling parameters.
      prompt_token_ids: its prompt (marks the tokens the repetition penalty applies to).
      eos_token_ids: the model's EOS ids (at most M).
      seed: used when `params.seed` is None; the engine passes e.g. its seed + request counter.
      banned: token ids of its bad words (the engine tokenizes them).

    Returns:
      The state with row `slot` replaced.
    """
    rows = sampling_rows([(params, list(eos_token_ids), seed)], 1, state.stop_ids.shape[1])
    prompt = np.zeros((1, state.vocab_size), bool)
    prompt[0, np.asarray(prompt_token_ids, np.int64)] = True
    bias = bias_row(params, state.vocab_size, banned)[None]
    return admit_rows(state, jnp.asarray([slot], jnp.int32), rows, jnp.asarray(prompt),
                      jnp.asarray(bias))


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
    keys = jax.vmap(lambda k, i: jax.random.key_data(jax.random.fold_in(wrap_key(k), i)))(
        state.key[src], index)
    return dataclasses.replace(copied, key=copied.key.at[dst].set(keys, mode="drop"))


def wrap_key(key_data: UInt[Array, "2"]) -> jax.Array:
    return jax.random.wrap_key_data(key_data, impl=KEY_IMPL)
