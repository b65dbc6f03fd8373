"""LoRA in the decoder (models/lora_ops.py, lora/weights.py, models/llama.py's with_lora) against
transformers + PEFT on the same weights: three adapters of different ranks, scales and
targets, and the base model, in one ragged batch; the grouped delta against its reference;
what the adapter loader refuses."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpp_build, cpu_lora
from paged_jax.cache.kv_cache import init_kv_cache
from paged_jax.lora import weights as lw
from paged_jax.lora.peft_folder import load_peft
from paged_jax.models import lora_ops
from paged_jax.models.llama import forward, prepare_params
from paged_jax.models.lora_ops import grouped_delta, lora_delta_reference
from paged_jax.models.safetensors_loader import load_safetensors
from tests.lora_helpers import ADAPTERS, hf_model, peft_logits, random_adapter

PROMPTS = [[5, 17, 3, 44, 8, 9, 1], [60, 2, 2, 31, 7], [11, 12, 13, 14, 15, 16], [90, 4, 33]]


def ragged_logits(config, params, prompts, slots) -> list[np.ndarray]:
    """Every token's logits of `prompts` in one ragged prefill, row r with adapter slot
    slots[r] (-1: the base model)."""
    lens = [len(p) for p in prompts]
    pages = -(-max(lens) // 8)
    qs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    tables = np.arange(1, 1 + len(prompts) * pages, dtype=np.int32).reshape(len(prompts), pages)
    cache_pos = np.concatenate([tables[r][np.arange(n) // 8] * 8 + np.arange(n) % 8
                                for r, n in enumerate(lens)]).astype(np.int32)
    token_slots = np.repeat(np.asarray(slots, np.int32), lens)
    cache = init_kv_cache(config.num_layers, config.num_kv_heads, 1 + tables.size, 8,
                          config.head_dim, jnp.float32)
    out, _ = forward(params, cache, jnp.asarray(np.concatenate(prompts), jnp.int32),
                     jnp.asarray(pos), jnp.asarray(cache_pos), jnp.asarray(tables),
                     jnp.asarray(lens, jnp.int32), jnp.asarray(qs), config=config,
                     max_q=max(lens), all_logits=True, lora_slots=jnp.asarray(token_slots))
    out = np.asarray(out)
    return [out[qs[r]:qs[r + 1]] for r in range(len(prompts))]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_mixed_batch_matches_peft_per_adapter(tmp_path, kind):
    """Base + three adapters in one batch, each row's logits within 1e-4 of PEFT's."""
    model = hf_model(tmp_path / "base", kind)
    folders = [random_adapter(model, tmp_path / f"a{i}", *spec, seed=i + 1)
               for i, spec in enumerate(ADAPTERS)]
    config, params = load_safetensors(tmp_path / "base")
    slots = lw.empty_slots(config, 4, rank=8)
    for i, f in enumerate(folders):  # slot 3 stays empty: a slot with no adapter is harmless
        slots = lw.write(slots, i, lw.slot_values(config, load_peft(f, config, 8), 8,
                                                  jnp.float32))
    params = {**prepare_params(params), "lora": dict(layers=slots)}
    order = [0, -1, 2, 1]  # adapters and the base model interleaved
    ours = ragged_logits(config, params, PROMPTS, order)
    for r, s in enumerate(order):
        want = peft_logits(tmp_path / "base", None if s < 0 else folders[s], PROMPTS[r])
        np.testing.assert_allclose(ours[r], want, atol=1e-4, rtol=0, err_msg=f"row {r}")
    base = ragged_logits(config, params, PROMPTS, [-1] * 4)
    assert not np.allclose(base[0], ours[0], atol=1e-3), "adapter 0 changed nothing"


def _kernel(isa: str | None = None) -> None:
    if not cpu_lora.load(str(cpp_build.default_folder()), isa):
        pytest.skip("the C++ LoRA kernel did not build")


# the C++ kernel's AVX-512 paths (native, on such a CPU) and its portable ones (x86-64-v2)
@pytest.mark.parametrize("path, dtype, isa", [
    ("grouped", jnp.float32, None), ("cpu", jnp.float32, None), ("cpu", jnp.bfloat16, None),
    ("cpu", jnp.float32, "x86-64-v2"), ("cpu", jnp.bfloat16, "x86-64-v2")])
def test_delta_matches_reference_for_any_mix(path, dtype, isa):
    if path == "cpu":
        _kernel(isa)
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((5, 12, 20)), dtype)
    bs = tuple(jnp.asarray(rng.standard_normal((5, 4, o)), dtype) for o in (16, 8, 72))
    delta = jax.jit(grouped_delta if path == "grouped" else
                    lambda *args: cpu_lora.delta(*args, isa=isa))
    for t in (1, 9, 64, 70):  # tiles of 8 rows, several per slot, and a partial one; the
        x = jnp.asarray(rng.standard_normal((t, 20)), jnp.float32)  # kernel's groups of 4
        for slots in (rng.integers(-1, 5, t), np.full(t, -1), np.full(t, 3)):
            s = jnp.asarray(slots, jnp.int32)
            got, want = delta(x, a, bs, s), lora_delta_reference(x, a, bs, s)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
            assert not np.any(np.asarray(got)[slots < 0]), "a row of no adapter got a delta"


@pytest.mark.parametrize("isa", [None, "x86-64-v2"])
def test_cpu_kernel_rows_do_not_depend_on_the_batch(isa):
    """A token's delta is the same alone or beside any other tokens (batch-invariant)."""
    _kernel(isa)
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((4, 32, 600)), jnp.float32)  # tails of every width
    bs = (jnp.asarray(rng.standard_normal((4, 16, 100)), jnp.float32),
          jnp.asarray(rng.standard_normal((4, 16, 7)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((11, 600)), jnp.float32)
    s = jnp.asarray(rng.integers(0, 4, 11), jnp.int32)
    batched = np.asarray(cpu_lora.delta(x, a, bs, s, isa=isa))
    for t in range(11):
        np.testing.assert_array_equal(cpu_lora.delta(x[t:t + 1], a, bs, s[t:t + 1], isa=isa)[0],
                                      batched[t])


@pytest.mark.parametrize("isa", [None, "x86-64-v2"])
@pytest.mark.parametrize("used", [12, 3])
def test_cpu_kernel_shares_out_jobs_of_many_or_few_slots(isa, used):
    """Calls big enough to share out between threads (jobs of up to 4 tokens of one slot),
    with 12 slots in use or 3: each row equals the reference and its own call alone."""
    _kernel(isa)
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal((12, 32, 64)), jnp.float32)
    bs = (jnp.asarray(rng.standard_normal((12, 16, 200)), jnp.float32),
          jnp.asarray(rng.standard_normal((12, 16, 400)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    slots = np.where(np.arange(40) % 7 == 6, -1, np.arange(40) % used)
    s = jnp.asarray(slots, jnp.int32)
    batched = np.asarray(cpu_lora.delta(x, a, bs, s, isa=isa))
    np.testing.assert_allclose(batched, lora_delta_reference(x, a, bs, s), atol=1e-3, rtol=1e-5)
    for t in (0, 5, 6, 39):
        np.testing.assert_array_equal(cpu_lora.delta(x[t:t + 1], a, bs, s[t:t + 1], isa=isa)[0],
                                      batched[t])


@pytest.mark.parametrize("isa", [None, "x86-64-v2"])
def test_cpu_kernel_adds_into_a_bfloat16_output_rounding_once(isa):
    """y + delta in y's dtype: rows of no adapter keep y bit for bit; the others are the
    float32 sum rounded to bfloat16 once (to nearest even), as XLA rounds y + delta."""
    _kernel(isa)
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal((3, 8, 40)), jnp.bfloat16)
    bs = (jnp.asarray(rng.standard_normal((3, 8, 24)), jnp.bfloat16),)
    x = jnp.asarray(rng.standard_normal((6, 40)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((6, 24)) * 50, jnp.bfloat16)
    s = jnp.asarray([0, -1, 2, 1, -1, 0], jnp.int32)
    got = jax.jit(lambda *v: cpu_lora.add(*v, isa=isa))(y, x, a, bs, s)
    assert got.dtype == jnp.bfloat16
    want = (y.astype(jnp.float32) + lora_delta_reference(x.astype(jnp.float32), a, bs, s)
            ).astype(jnp.bfloat16)
    keep = np.asarray(s) < 0
    np.testing.assert_array_equal(np.asarray(got)[keep], np.asarray(y)[keep])
    ulps = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)) / np.maximum(
        np.abs(np.asarray(want, np.float32)), 1e-3)
    assert ulps.max() <= 2 ** -7, "more than one bfloat16 rounding off"


def test_the_engine_runs_the_cpu_kernel_where_it_builds():
    s = jnp.asarray([0, -1, 1], jnp.int32)
    prepared = lora_ops.prepare(s, 2)
    assert isinstance(prepared, lora_ops.Plan) != lora_ops.cpu_kernel()


@pytest.mark.parametrize("change, refused", [
    (dict(use_dora=True), "DoRA"), (dict(bias="lora_only"), "bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"), (dict(r=32), "max_lora_rank")])
def test_the_loader_refuses_what_slots_cannot_hold(tmp_path, change, refused):
    model = hf_model(tmp_path / "base")
    folder = random_adapter(model, tmp_path / "a", *ADAPTERS[0], seed=1)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
    config, _ = load_safetensors(tmp_path / "base")
    with pytest.raises(ValueError, match=refused):
        load_peft(folder, config, max_rank=16)
