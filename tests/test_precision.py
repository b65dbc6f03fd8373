"""dtype="auto" on CPU (paged_jax/precision.py): the fastest of float32, bfloat16 (where this
CPU's kernel has bfloat16 dot products) and a 4-bit checkpoint's own codes (int8 packing)
whose passage perplexity holds within 0.5% of float32's, checked once per checkpoint and
machine; an explicit dtype or quantization always wins."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpu_matmul
from paged_jax import LLM, llm_setup, precision
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config

ALL_PATHS = cpu_matmul.PATH_BF16_DOT | cpu_matmul.PATH_INT8_ROWS


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The checks' cache file in tmp_path (not the cache folder: the kernels load from it)."""
    monkeypatch.setattr(precision, "cache_file", lambda: tmp_path / "precision.json")
    return tmp_path


def fake_measures(monkeypatch, measured: dict, paths: int = ALL_PATHS) -> list:
    """precision.measure answering `measured` per side name (perplexity, seconds; a side not
    named is past the quality bar), on a kernel with `paths`; returns the (weights, pages)
    measured, in order."""
    calls = []

    def measure(config, params, tokenizer, weights, pages):
        calls.append((weights, tuple(pages)))
        return {precision.side(weights, p): dict(measured.get(
            precision.side(weights, p), dict(perplexity=1e9, seconds=0.1))) for p in pages}

    monkeypatch.setattr(precision, "measure", measure)
    monkeypatch.setattr(precision, "kernel_paths", lambda: paths)
    return calls


@pytest.mark.parametrize("bf16, want", [(10.04, "bfloat16"), (10.06, "float32")])
def test_the_quality_gate_decides_and_is_checked_once(cache, monkeypatch, bf16, want):
    calls = fake_measures(monkeypatch, {
        "float32": dict(perplexity=10.0, seconds=2.0), "bfloat16": dict(perplexity=bf16,
                                                                        seconds=1.0),
        "int8": dict(kept_grid=0.0), "int8, bfloat16 pages": dict(kept_grid=0.0)})
    c = tiny_config()
    first = precision.choose(c, None, None, "ckpt-a")
    assert first["dtype"] == want and first["quantization"] is None
    assert first["kv_cache_dtype"] == "auto"
    assert f"bfloat16: perplexity {bf16:.4f} ({'within' if want == 'bfloat16' else 'past'}" in (
        first["reason"]) and "int8: 0% of the weights on a 4-bit grid" in first["reason"]
    assert precision.choose(c, None, None, "ckpt-a") == first and len(calls) == 3  # cached
    precision.choose(c, None, None, "ckpt-b")  # another checkpoint: checked again
    assert len(calls) == 6 and (cache / "precision.json").exists()
    monkeypatch.setattr(precision, "METHOD", precision.METHOD + 1)  # the check changed
    precision.choose(c, None, None, "ckpt-a")
    assert len(calls) == 9


F32, BF16 = dict(perplexity=10.0, seconds=2.0), dict(perplexity=10.01, seconds=1.0)


@pytest.mark.parametrize("int8, int8_bf16_pages, want", [
    (dict(kept_grid=0.9, perplexity=10.03, seconds=0.5), None, "int8"),  # own codes, fastest
    (dict(kept_grid=0.9, perplexity=10.03, seconds=1.5), None, "bfloat16"),  # slower
    (dict(kept_grid=0.9, perplexity=10.3, seconds=0.5), None, "bfloat16"),  # past the bar
    (dict(kept_grid=0.2), dict(kept_grid=0.2), "bfloat16"),  # not a 4-bit checkpoint
    (dict(kept_grid=0.9, perplexity=10.03, seconds=0.5),  # bfloat16 pages faster still
     dict(kept_grid=0.9, perplexity=10.04, seconds=0.4), "int8, bfloat16 pages"),
    (dict(kept_grid=0.9, perplexity=10.03, seconds=0.5),  # ... but past the bar
     dict(kept_grid=0.9, perplexity=10.06, seconds=0.4), "int8")])
def test_the_fastest_side_within_quality_wins(cache, monkeypatch, int8, int8_bf16_pages, want):
    fake_measures(monkeypatch, {"float32": F32, "bfloat16": BF16, "int8": int8,
                                "int8, bfloat16 pages": int8_bf16_pages or dict(
                                    kept_grid=0.9, perplexity=10.0, seconds=9.0)})
    got = precision.choose(tiny_config(), None, None, "ckpt")
    assert got["side"] == want
    assert (got["dtype"], got["quantization"], got["kv_cache_dtype"]) == {
        "int8": ("float32", "int8", "auto"), "bfloat16": ("bfloat16", None, "auto"),
        "int8, bfloat16 pages": ("float32", "int8", "bfloat16")}[want]


def test_float32_weights_over_bfloat16_pages_are_a_side(cache, monkeypatch):
    calls = fake_measures(monkeypatch, {"float32": F32, "float32, bfloat16 pages": dict(
        perplexity=10.02, seconds=1.8)}, paths=cpu_matmul.PATH_INT8_ROWS)
    got = precision.choose(tiny_config(), None, None, "ckpt", quantize=False)
    assert calls == [("float32", ("float32", "bfloat16"))]
    assert (got["weights"], got["kv_cache_dtype"], got["dtype"]) == (
        "float32", "bfloat16", "float32")


def test_without_bfloat16_dot_products_int8_is_still_tried(cache, monkeypatch):
    calls = fake_measures(monkeypatch, {"float32": F32, "int8": dict(
        kept_grid=1.0, perplexity=10.0, seconds=1.0)}, paths=cpu_matmul.PATH_INT8_ROWS)
    assert precision.choose(tiny_config(), None, None, "ckpt")["weights"] == "int8"
    assert calls == [("float32", ("float32", "bfloat16")), ("int8", ("float32", "bfloat16"))]


def test_nothing_to_try_keeps_float32_unchecked(cache, monkeypatch):
    calls = fake_measures(monkeypatch, {}, paths=0)
    got = precision.choose(tiny_config(), None, None, "ckpt")
    assert (got["dtype"], got["quantization"], got["weights"], got["kv_cache_dtype"]) == (
        "float32", None, "float32", "auto")
    assert not calls
    assert "do not run here" in got["reason"]


def test_the_passage_perplexity_is_measured_on_every_path(cache):
    """The tiny model's real passage perplexity (random weights: a large one) on the packed
    paths and both pages: finite and the same to within bfloat16's rounding; int8 measured
    only on weights that lie on 4-bit grids (snapped to them here: its own codes, kept
    exactly), where only x's int8 codes move it; each side's step timed at every row count."""
    c = tiny_config()
    params, tok = random_params(c), byte_tokenizer()
    f32 = precision.passage_perplexity(c, params, tok, "float32")
    for weights, pages in (("bfloat16", None), ("float32", "bfloat16")):
        got = precision.passage_perplexity(c, params, tok, weights, pages=pages)
        assert 1 < f32 < float("inf") and abs(got / f32 - 1) < 0.05, (f32, got, weights)
        assert got != f32  # bfloat16 somewhere: the weights, or the pages asked for
    assert precision.measure(c, params, tok, "int8", ["float32"]) == {
        "int8": dict(kept_grid=0.0)}  # random weights
    snapped = precision.measure(c, snap_to_grids(params), tok, "int8", ["float32", "bfloat16"])
    ref = precision.passage_perplexity(c, snap_to_grids(params), tok, "float32")
    for m in (snapped["int8"], snapped["int8, bfloat16 pages"]):
        assert m["kept_grid"] > 0.5 and m["seconds"] > 0
        assert len(m["matmuls"]) == len(m["attention"]) == len(precision.ROWS)
        assert abs(m["perplexity"] / ref - 1) < 0.05, (snapped, ref)


def snap_to_grids(params: dict) -> dict:
    """Every projection's groups of 32 inputs rounded to 16 levels between their min and
    max (as a GGUF Q4_1 tensor dequantizes): a layer's weights are [in, out], the embedding
    and head [out, in]."""
    import jax

    def snap(w, axis):
        g = np.moveaxis(np.asarray(w, np.float32), axis, -1)
        g = g.reshape(*g.shape[:-1], -1, 32)
        lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
        step = np.where(hi > lo, (hi - lo) / 15, 1)
        g = (np.rint((g - lo) / step) * step + lo).astype(np.float32)
        return np.moveaxis(g.reshape(*g.shape[:-2], -1), -1, axis)

    layers = {k: snap(v, -2) if v.ndim == 3 else v for k, v in params["layers"].items()}
    return {**jax.tree.map(lambda x: x, params), "layers": layers,
            **{k: snap(params[k], -1) for k in ("embed", "lm_head") if k in params}}


def test_an_explicit_dtype_and_given_weights_are_not_second_guessed(monkeypatch):
    monkeypatch.setattr(precision, "choose", lambda *a, **k: pytest.fail("checked"))
    c = tiny_config()
    parts = (c, random_params(c), byte_tokenizer())
    assert LLM(model_parts=parts, max_num_seqs=2).dtype_choice["dtype"] == "float32"
    llm = LLM(model_parts=parts, dtype="float32", max_num_seqs=2)
    assert llm.dtype_choice == dict(dtype="float32", quantization=None, kv_cache_dtype="auto",
                                    reason="asked for")
    assert llm.engine_config.quantization is None


def test_a_loaded_checkpoint_runs_the_choice_and_xla_matmuls_are_not_quantized(monkeypatch):
    """LLM's setup asks the check for a checkpoint it loads (int8 may be chosen unless the
    user asked for XLA's matmuls, which do not run int8) and runs what it returns."""
    seen = []

    def choose(config, params, tok, key, quantize=True):
        seen.append(quantize)
        return dict(dtype="float32", quantization="int8" if quantize else None,
                    weights="int8" if quantize else "float32", kv_cache_dtype="bfloat16",
                    reason="fake")

    monkeypatch.setattr(precision, "choose", choose)
    c = tiny_config()
    for backend in (None, "xla"):
        got, _ = llm_setup._choose_dtype("auto", "float32", "no-such-model", None, None, c,
                                         random_params(c), byte_tokenizer(), backend)
        assert got["quantization"] == (None if backend == "xla" else "int8")
        assert got["kv_cache_dtype"] == "bfloat16"
    assert seen == [True, False]
    got, _ = llm_setup._choose_dtype("auto", "float32", "no-such-model", None, None, c,
                                     random_params(c), byte_tokenizer(), None, "float32")
    assert got["kv_cache_dtype"] == "float32"  # set: wins over the check's pages
    got, _ = llm_setup._choose_dtype("auto", "float32", "m", None, "int4", c, None, None)
    assert got["quantization"] == "int4" and not seen[3:]  # asked for: not checked


def test_llm_runs_the_quantization_and_pages_the_check_chose(tmp_path, monkeypatch):
    """LLM(path) with nothing set runs what the check returns: its engine packs int8 and
    keeps bfloat16 pages when that is the choice (a choice recorded but not run would pass
    the tests above); a kv_cache_dtype set wins over the check's pages."""
    from tests.test_models_gguf import hf_weights, write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_weights(np.random.default_rng(0)))
    monkeypatch.setattr(precision, "choose", lambda *a, **k: dict(
        dtype="float32", quantization="int8", weights="int8", kv_cache_dtype="bfloat16",
        reason="fake"))
    llm = LLM(str(path), max_num_seqs=2)
    assert llm.engine_config.quantization == "int8"
    assert llm.llm_engine.params["layers"][0]["w_qkv"].scales is not None
    assert llm.llm_engine.runner.state.cache.k[0].dtype == jnp.uint16  # bfloat16 bits
    set_ = LLM(str(path), max_num_seqs=2, kv_cache_dtype="float32")
    assert set_.llm_engine.runner.state.cache.k[0].dtype == jnp.float32


def test_an_untied_embedding_table_is_not_timed_as_a_matmul(monkeypatch):
    """A step multiplies by the head, not by an untied embedding table (a row of it is read
    per token): the 1.5B's 146 MB table was timed as a matmul, 6 ms a step."""
    c = tiny_config()
    laid = precision.laid_out(random_params(c), "float32")  # its own lm_head: untied
    untied = {**laid, "embed": laid["lm_head"]}  # a packed table beside the head (int8's)
    tied = {k: v for k, v in untied.items() if k != "lm_head"}  # the table is the head
    timed = []
    monkeypatch.setattr(precision, "best_of", lambda f, args, **k: timed.append(len(args[0])))
    precision.matmul_times(untied, rows=(1,))
    precision.matmul_times(tied, rows=(1,))
    n = len(precision.packed_weights(tied))
    assert timed == [n, n] and len(precision.packed_weights(untied)) == n + 1
