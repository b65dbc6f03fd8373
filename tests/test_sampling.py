"""Sampler: greedy, filters, penalties, per-request determinism, statistics, stop detection."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_rows
from paged_jax.sample.sampler import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_STOP_TOKEN,
    apply_penalties,
    filter_logits,
    fork_slot,
    init_sampling_state,
    sample,
    seed_to_key_data,
    set_slot,
    stop_mask,
    update_rows,
)
from paged_jax.sampling_params import SamplingParams

S, V = 4, 16
EOS = 15
_sample = jax.jit(sample, static_argnums=2)


@jax.jit
def _update(state, tokens, active):
    """Counts every slot's token (history included), as a step over all S rows does."""
    return update_rows(state, jnp.arange(state.max_seqs), tokens, active, True)


def _logits(seed: int, s: int = S, v: int = V) -> np.ndarray:
    return np.array(jax.random.normal(jax.random.PRNGKey(seed), (s, v)) * 3.0)


def _state(params: list[SamplingParams], prompts=None, seeds=None, v: int = V):
    state = init_sampling_state(len(params), v)
    for slot, p in enumerate(params):
        prompt = prompts[slot] if prompts else [0]
        state = set_slot(state, slot, p, prompt, [EOS], seed=seeds[slot] if seeds else slot)
    return state


def _all(p: SamplingParams) -> list[SamplingParams]:
    return [p] * S


# ---- greedy and degenerate filters --------------------------------------------------------


def test_greedy_is_argmax():
    logits = _logits(0)
    out = _sample(jnp.asarray(logits), _state(_all(SamplingParams(temperature=0.0))), 0)
    np.testing.assert_array_equal(out.tokens, np.argmax(logits, axis=1))


def test_greedy_ties_go_to_lowest_id():
    logits = np.zeros((S, V), np.float32)
    logits[:, [3, 7]] = 1.0
    out = _sample(jnp.asarray(logits), _state(_all(SamplingParams(temperature=0.0))), 0)
    np.testing.assert_array_equal(out.tokens, 3)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)],
    ids=["top_k=1", "top_p=tiny", "min_p=1"],
)
def test_degenerate_filters_are_greedy(params):
    for seed in range(5):
        logits = _logits(seed)
        out = _sample(jnp.asarray(logits), _state(_all(params), seeds=[seed] * S), 0)
        np.testing.assert_array_equal(out.tokens, np.argmax(logits, axis=1))


def _reference_keep(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The kept vocabulary of one row, by vLLM v1's rules (min_p, top_k, top_p), in numpy."""
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    order = np.argsort(-scaled, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        kept = np.where(keep, probs, 0.0)
        kept /= kept.sum()
        exclusive = np.cumsum(kept[order]) - kept[order]
        keep[order[exclusive >= top_p]] = False
    keep[order[0]] = True
    return keep


@pytest.mark.parametrize("top_k, top_p, min_p", [(3, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2),
                                                 (5, 0.8, 0.05)])
def test_filter_logits_matches_reference(top_k, top_p, min_p):
    params = SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p)
    logits = _logits(1)
    out = np.asarray(filter_logits(jnp.asarray(logits), _state(_all(params))))
    for row in range(S):
        keep = _reference_keep(logits[row], top_k, top_p, min_p)
        np.testing.assert_array_equal(np.isfinite(out[row]), keep)
        np.testing.assert_allclose(out[row][keep], logits[row][keep])


def test_filters_off_is_identity():
    logits = _logits(2)
    out = filter_logits(jnp.asarray(logits), _state(_all(SamplingParams())))
    np.testing.assert_array_equal(out, logits)


@settings(max_examples=40, deadline=None)
@given(
    top_k=st.integers(0, V), top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.9),
    temperature=st.floats(0.1, 3.0), seed=st.integers(0, 2**31 - 1),
)
def test_sampled_token_is_in_filtered_support(top_k, top_p, min_p, temperature, seed):
    params = SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
    logits = _logits(seed % 1000)
    out = _sample(jnp.asarray(logits), _state(_all(params), seeds=[seed + i for i in range(S)]), 0)
    for row, token in enumerate(np.asarray(out.tokens)):
        scaled = logits[row] / np.float32(temperature)
        keep = _reference_keep(scaled, top_k, top_p, min_p)
        # Float rounding may move the top_p boundary by one token; allow the next one in line.
        order = np.argsort(-scaled, kind="stable")
        allowed = order[: keep.sum() + 1] if top_p < 1.0 else np.flatnonzero(keep)
        assert token in set(allowed.tolist())


# ---- penalties ----------------------------------------------------------------------------


def test_penalties_follow_vllm():
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3)
    state = _state(_all(params), prompts=[[1, 2]] * S)
    state = _update(state, jnp.full((S,), 2), jnp.ones((S,), bool))
    state = _update(state, jnp.full((S,), 5), jnp.ones((S,), bool))
    state = _update(state, jnp.full((S,), 5), jnp.ones((S,), bool))
    logits = _logits(3)
    out = np.asarray(apply_penalties(jnp.asarray(logits), state))

    expected = logits.copy()
    counts = np.zeros(V)
    counts[2], counts[5] = 1, 2
    seen = counts > 0
    seen[[1, 2]] = True
    expected[:, seen] = np.where(expected[:, seen] > 0, expected[:, seen] / 1.5,
                                 expected[:, seen] * 1.5)
    expected -= 0.5 * counts + 0.3 * (counts > 0)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_default_penalties_change_nothing():
    state = _state(_all(SamplingParams()), prompts=[[1, 2, 3]] * S)
    state = _update(state, jnp.full((S,), 4), jnp.ones((S,), bool))
    logits = _logits(4)
    np.testing.assert_array_equal(apply_penalties(jnp.asarray(logits), state), logits)


def test_repetition_penalty_steers_greedy():
    logits = np.zeros((S, V), np.float32)
    logits[:, 6], logits[:, 7] = 2.0, 1.5
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    state = _state(_all(params), prompts=[[6]] * S)
    np.testing.assert_array_equal(_sample(jnp.asarray(logits), state, 0).tokens, 7)


# ---- determinism --------------------------------------------------------------------------


def _run(state, logits_fn, steps: int) -> np.ndarray:
    """Tokens [steps, S] from `steps` sample + update rounds."""
    tokens = []
    for step in range(steps):
        out = _sample(jnp.asarray(logits_fn(step)), state, 0)
        state = _update(state, out.tokens, jnp.ones(out.tokens.shape, bool))
        tokens.append(np.asarray(out.tokens))
    return np.stack(tokens)


@pytest.mark.parametrize("filtered", [True, False])
def test_seeded_request_is_batch_composition_independent(filtered):
    # Unfiltered: batch A needs no filtering at all (fast path), batch B does (sort path).
    mine = SamplingParams(temperature=0.9, top_p=0.9 if filtered else 1.0, seed=1234)
    others_a = [SamplingParams(temperature=1.3, seed=1), SamplingParams(temperature=0.0),
                SamplingParams(repetition_penalty=1.2)]
    others_b = [SamplingParams(min_p=0.3), SamplingParams(temperature=0.5, seed=9),
                SamplingParams()]
    row = lambda step: _logits(100 + step)[0]  # noqa: E731 - the request's own logits

    def batch(slot, others, salt):
        def logits_fn(step):
            x = _logits(200 + step + salt)  # other rows see unrelated logits
            x[slot] = row(step)
            return x
        params = others[:slot] + [mine] + others[slot:]
        return _run(_state(params, seeds=[salt + i for i in range(S)]), logits_fn, 16)[:, slot]

    a = batch(0, others_a, 0)
    b = batch(3, others_b, 50)
    np.testing.assert_array_equal(a, b)


def test_jit_equals_eager():
    params = [SamplingParams(temperature=0.8, top_k=4, seed=s) for s in range(S)]
    state, logits = _state(params), jnp.asarray(_logits(5))
    eager = sample(logits, state, 2)
    jitted = _sample(logits, state, 2)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_array_equal(a, b)


def test_unseeded_request_uses_engine_seed():
    params = _all(SamplingParams())
    logits = lambda step: np.tile(_logits(step)[:1], (S, 1))  # noqa: E731
    same = _run(_state(params, seeds=[7] * S), logits, 4)
    assert (same == same[:, :1]).all()  # identical engine seeds -> identical draws


def test_seed_to_key_data_matches_prng_key():
    for seed in [0, 1, 12345, 2**31 - 1]:
        np.testing.assert_array_equal(seed_to_key_data(seed),
                                      jax.random.key_data(jax.random.PRNGKey(seed)))


def test_fork_slot_copies_params_with_a_distinct_key():
    state = _state([SamplingParams(temperature=1.0, top_k=5, seed=3)] + _all(SamplingParams())[1:])
    forked = fork_slot(state, 0, 2, 1)
    for name in ["temperature", "top_k", "top_p", "max_tokens", "prompt_mask", "stop_ids"]:
        np.testing.assert_array_equal(getattr(forked, name)[2], getattr(state, name)[0])
    assert not np.array_equal(forked.key[2], forked.key[0])
    np.testing.assert_array_equal(forked.key, fork_slot(state, 0, 2, 1).key)  # deterministic
    logits = np.tile(_logits(6)[:1], (S, 1))
    tokens = _run(forked, lambda _: logits, 20)
    assert not np.array_equal(tokens[:, 0], tokens[:, 2])


# ---- statistics ---------------------------------------------------------------------------


def _many_rows(params: SamplingParams, rows: int, v: int):
    base = _state([params], v=v)
    keys = np.stack([seed_to_key_data(s) for s in range(rows)])
    return jax.tree.map(lambda a: jnp.repeat(a, rows, axis=0), base), keys


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.5, 0), (2.0, 3)])
def test_empirical_distribution_matches_softmax(temperature, top_k):
    rows, v = 8192, 8
    state, keys = _many_rows(SamplingParams(temperature=temperature, top_k=top_k), rows, v)
    state = dataclasses.replace(state, key=jnp.asarray(keys))
    row = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (v,)))
    out = _sample(jnp.tile(jnp.asarray(row), (rows, 1)), state, 0)
    freq = np.bincount(np.asarray(out.tokens), minlength=v) / rows
    scaled = row / temperature
    if top_k:
        scaled = np.where(scaled >= np.sort(scaled)[-top_k], scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    np.testing.assert_allclose(freq, probs, atol=0.02)


# ---- logprobs -----------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax():
    params = _all(SamplingParams(temperature=0.5, repetition_penalty=1.7, seed=1))
    logits = _logits(8)
    out = _sample(jnp.asarray(logits), _state(params, prompts=[[0, 1, 2]] * S), 3)
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=1))
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(S), tokens], rtol=1e-6)
    order = np.argsort(-raw, axis=1)
    np.testing.assert_array_equal(out.top_ids, order[:, :3])
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(raw, order[:, :3], 1))
    ranks = [int(np.flatnonzero(order[r] == tokens[r])[0]) + 1 for r in range(S)]
    np.testing.assert_array_equal(out.ranks, ranks)


# ---- min_tokens and stop detection --------------------------------------------------------


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = np.zeros((S, V), np.float32)
    logits[:, EOS], logits[:, 9], logits[:, 4] = 10.0, 9.0, 1.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    state = _state(_all(params))
    for step in range(4):
        out = _sample(jnp.asarray(logits), state, 0)
        state = _update(state, out.tokens, jnp.ones((S,), bool))
        finished, reason = stop_mask(state, out.tokens)
        if step < 3:
            np.testing.assert_array_equal(out.tokens, 4)
            assert not finished.any()
        else:
            np.testing.assert_array_equal(out.tokens, EOS)
            np.testing.assert_array_equal(reason, FINISH_EOS)


def _stop_state(params: list[SamplingParams], generated: int):
    state = _state(params)
    for _ in range(generated):
        state = _update(state, jnp.zeros((S,), jnp.int32), jnp.ones((S,), bool))
    return state


def test_stop_mask_reasons():
    params = [SamplingParams(max_tokens=3), SamplingParams(stop_token_ids=[7]),
              SamplingParams(ignore_eos=True, stop_token_ids=[7]), SamplingParams(max_tokens=10)]
    state = _stop_state(params, 3)
    finished, reason = stop_mask(state, jnp.array([5, 7, EOS, EOS]))
    expected = [FINISH_LENGTH, FINISH_STOP_TOKEN, FINISH_NONE, FINISH_EOS]
    np.testing.assert_array_equal(reason, expected)
    np.testing.assert_array_equal(finished, [True, True, False, True])


def test_length_wins_over_eos_and_min_tokens_gates_stops():
    params = [SamplingParams(max_tokens=2), SamplingParams(min_tokens=4, stop_token_ids=[7])] * 2
    state = _stop_state(params, 2)
    _, reason = stop_mask(state, jnp.array([EOS, 7, EOS, EOS]))
    np.testing.assert_array_equal(reason, [FINISH_LENGTH, FINISH_NONE, FINISH_LENGTH, FINISH_NONE])


def test_padding_ids_never_match():
    state = _stop_state(_all(SamplingParams(ignore_eos=True)), 1)
    finished, _ = stop_mask(state, jnp.full((S,), -1))
    assert not finished.any()


def test_update_counts_only_active_rows():
    state = _state(_all(SamplingParams()))
    state = _update(state, jnp.array([3, 3, 4, 5]), jnp.array([True, False, True, False]))
    np.testing.assert_array_equal(state.num_generated, [1, 0, 1, 0])
    np.testing.assert_array_equal(state.output_counts.sum(axis=1), [1, 0, 1, 0])
    assert state.output_counts[0, 3] == 1 and state.output_counts[2, 4] == 1


def test_set_slot_rejects_too_many_stop_ids():
    with pytest.raises(ValueError, match="stop_token_ids"):
        set_slot(init_sampling_state(2, V, max_stop_ids=2), 0,
                 SamplingParams(stop_token_ids=[1, 2, 3]), [0], [EOS], seed=0)


def test_set_slot_resets_history():
    state = _stop_state(_all(SamplingParams()), 2)
    state = set_slot(state, 1, SamplingParams(max_tokens=None), [4], [EOS], seed=0)
    assert state.num_generated[1] == 0 and state.output_counts[1].sum() == 0
    assert state.num_generated[0] == 2 and bool(state.prompt_mask[1, 4])


def test_shape_annotations_hold_at_run_time():
    from beartype import beartype
    from jaxtyping import jaxtyped

    import paged_jax.sample.sampler as sampling

    chk = lambda f: jaxtyped(typechecker=beartype)(f)  # noqa: E731
    state = chk(sampling.SamplingState)(**vars(_state(_all(SamplingParams(seed=1)))))
    out = chk(sample)(jnp.asarray(_logits(9)), state, 2)
    state = chk(update_rows)(state, jnp.arange(S), out.tokens, jnp.ones((S,), bool), True)
    chk(stop_mask)(state, out.tokens)
    chk(fork_slot)(state, jnp.int32(0), jnp.int32(1), jnp.int32(1))
    chk(sampling.SampleResult)(**vars(out))


# ---- logit bias, allowed ids, bad words ----------------------------------------------------


def test_logit_bias_and_allowed_ids_steer_greedy_and_stale_rows_are_not_read():
    logits = _logits(7)
    params = [SamplingParams(temperature=0.0, logit_bias={3: 100.0}),
              SamplingParams(temperature=0.0, allowed_token_ids=[5, 9]),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, seed=1, allowed_token_ids=[2])]
    state = _state(params)
    out = _sample(jnp.asarray(logits), state, 0)
    assert int(out.tokens[0]) == 3 and int(out.tokens[3]) == 2
    assert int(out.tokens[1]) == [5, 9][int(np.argmax(logits[1, [5, 9]]))]
    assert int(out.tokens[2]) == int(np.argmax(logits[2]))
    # slot 0 re-admitted without a bias: its old row stays in memory but is not read
    state = set_slot(state, 0, SamplingParams(temperature=0.0), [0], [EOS], seed=0)
    out = _sample(jnp.asarray(logits), state, 0)
    assert int(out.tokens[0]) == int(np.argmax(logits[0]))


def test_bias_checks_name_the_field():
    for kwargs, field in [(dict(logit_bias={1: float("inf")}), "logit_bias"),
                          (dict(logit_bias={-1: 1.0}), "logit_bias"),
                          (dict(allowed_token_ids=[]), "allowed_token_ids"),
                          (dict(bad_words=[""]), "bad_words")]:
        with pytest.raises(ValueError, match=f"^{field} "):
            SamplingParams(**kwargs)


def test_top_k_in_blocks_is_lax_top_k_ties_included():
    from paged_jax.sample.logprobs import top_k_blocks

    rng = np.random.default_rng(3)
    for v, k in ((1000, 1), (1000, 5), (4099, 20), (50, 20)):
        x = rng.standard_normal((6, v)).astype(np.float32)
        x[3] = rng.integers(0, 4, v)  # ties everywhere: the lower index first
        x[4, ::7] = np.inf
        want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
        got_v, got_i = top_k_blocks(jnp.asarray(x), k)
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_array_equal(got_v, want_v)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_logprobs_of_the_sampled_rows_only_match_all_rows(dtype):
    """with_logprobs(active=...) (on CPU: the active rows one at a time) gives the active
    rows what the whole-batch computation gives them, and zeros elsewhere."""
    from paged_jax.sample.sampler import SampleFlags, with_logprobs

    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.standard_normal((8, 3000)) * 3, dtype)
    tokens = jnp.asarray(rng.integers(0, 3000, 8), jnp.int32)
    active = jnp.asarray([True, False, False, True, False, False, False, True])
    flags = SampleFlags(logprobs=True, num_top_logprobs=4)
    every = with_logprobs(logits, tokens, flags)
    some = jax.jit(lambda *a: with_logprobs(*a, flags, active))(logits, tokens)
    on = np.asarray(active)
    for a, b in ((some.logprobs, every.logprobs), (some.top_logprobs, every.top_logprobs)):
        np.testing.assert_allclose(np.asarray(a)[on], np.asarray(b)[on], rtol=1e-6, atol=1e-6)
    for a, b in ((some.ranks, every.ranks), (some.top_ids, every.top_ids)):
        np.testing.assert_array_equal(np.asarray(a)[on], np.asarray(b)[on])
    if jax.default_backend() == "cpu":
        assert not np.asarray(some.top_ids)[~on].any() and not np.asarray(some.ranks)[~on].any()


@pytest.mark.parametrize("v, j", [(257, 0), (3000, 4), (49155, 20), (152064, 20)])
def test_the_cpu_logprobs_kernel_and_the_xla_loop_match_gather(v, j):
    """kernels/cpu_logprobs.h (what with_logprobs runs on CPU) and gather_active (its
    fallback where the kernel does not build) against gather: ties to the lower id, ranks
    counted exactly, inactive rows zeros."""
    from paged_jax.sample import logprobs as lp
    from paged_jax.sample.sampler import _cpu_argmax

    rng = np.random.default_rng(v)
    x = (rng.standard_normal((6, v)) * 4).astype(np.float32)
    x[1] = rng.integers(0, 5, v)  # ties everywhere
    x[2] = 0.5  # one value
    x[4, ::3] = 9.0
    logits, tokens = jnp.asarray(x), jnp.asarray(rng.integers(0, v, 6), jnp.int32)
    active = jnp.asarray([True, True, True, False, True, True])
    want = [np.asarray(a) for a in lp.gather(logits, tokens, j)]
    sides = {"loop": lp.gather_active(logits, tokens, j, active)}
    if _cpu_argmax():
        sides["kernel"] = cpu_rows.row_logprobs(logits, tokens, active, j)
    on = np.asarray(active)
    for name, got in sides.items():
        got = [np.asarray(a) for a in got]
        for k in (0, 3):  # logprobs: the kernel's own exp, within float rounding
            np.testing.assert_allclose(got[k][on], want[k][on], rtol=1e-6, atol=2e-6,
                                       err_msg=name)
        for k in (1, 2):
            np.testing.assert_array_equal(got[k][on], want[k][on], err_msg=name)
        assert not any(a[~on].any() for a in got), name
