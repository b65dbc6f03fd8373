"""make gpu-bench's CPU-side parts: the plan, the engine section on a tiny model, the outputs,
and that it needs nothing the GPU machine's python lacks (no tokenizer, no checkpoint)."""

from __future__ import annotations

import json

import jax
import pytest

from experiments import gpu_bench
from tests.blocked_imports import run_without

TINY_MODEL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                  eos_token_ids=(299,))
TINY_ENGINE = dict(block_size=8, num_kv_blocks=65, max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=128, decode_window=4, enable_prefix_caching=False)
TINY = dict(model=TINY_MODEL, engine=TINY_ENGINE,
            workload=dict(dataset="sharegpt", requests=6, scale=0.1, seed=0),
            decode=dict(batch=4, prompt=16, tokens=12))


def test_plan_and_no_gpu(capsys):
    plan = gpu_bench.make_plan(270)
    text = plan.describe()
    assert "16 layers" in text and "32/8" in text and "4096 blocks of 16" in text
    assert plan.engine_budget_s + plan.moe_budget_s == pytest.approx(270)
    assert gpu_bench.main(["--dry-run"]) == 0
    if jax.default_backend() != "gpu":
        assert gpu_bench.main([]) == 2
        assert "no GPU" in capsys.readouterr().err


def test_llama_1b_shapes():
    """The benchmark's model has Llama-3.2-1B's parameter count (tied embeddings)."""
    shapes = jax.eval_shape(lambda: gpu_bench.random_model(gpu_bench.LLAMA_1B)[1])
    n = sum(x.size for x in jax.tree.leaves(shapes))
    assert 1.23e9 < n < 1.25e9, n


def test_engine_section_and_outputs(tmp_path):
    plan = gpu_bench.make_plan(120, **TINY)
    res = gpu_bench.run_engine(plan, bandwidth=20e9, budget_s=600)
    items = gpu_bench.workload_items(plan)
    rows = {r["policy"]: r for r in res["policies"]}
    assert set(rows) == set(gpu_bench.POLICIES)
    for r in rows.values():  # every policy serves the whole workload, token for token
        assert r["complete"] and r["finished"] == len(items)
        assert r["output_tokens"] == sum(w.output_len for w in items)
    # per step: weighted by wall-clock duration, two workers on two cores flipped it (1.56 vs 2.02)
    assert rows["paged"]["mean_batch_per_step"] >= rows["static"]["mean_batch_per_step"]
    assert res["decode"]["step_ms"] > 0 and res["decode"]["ratio"] > 0
    paths = gpu_bench.write(dict(engine=res), tmp_path)
    assert json.loads(paths[0].read_text())["engine"]["policies"][0]["policy"] == "paged"
    assert (tmp_path / "gpu_bench.png").stat().st_size > 0


def test_moe_section_times_every_path():
    """Section 3 on a small MoE MLP in float32 on this CPU: every path timed, grouped over
    dense reported."""
    from paged_jax.models import moe

    shape = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    res = gpu_bench.moe_mlp(600, shape=shape, tokens=(1, 16), dtype="float32")
    assert {(r["tokens"], r["impl"]) for r in res["rows"] if r["ms"] > 0} == {
        (t, i) for t in (1, 16) for i in moe.IMPLS}
    assert set(res["grouped_over_dense"]) == {"1", "16"}


BLOCKED = ("tokenizers", "tqdm", "gguf", "safetensors", "jinja2", "transformers", "torch",
           "matplotlib", "hypothesis")


def test_runs_with_only_jax_numpy_and_jaxtyping(tmp_path):
    """The GPU machine's python has jax, numpy and jaxtyping but none of these."""
    run_without(BLOCKED, f"""
        from experiments import gpu_bench
        from tests.test_gpu_bench import TINY
        tiny = dict(TINY, workload=dict(TINY["workload"], requests=2))
        res = gpu_bench.run_engine(gpu_bench.make_plan(60, **tiny), 20e9, 600)
        assert all(r["complete"] for r in res["policies"]), res
        moe = gpu_bench.moe_mlp(60, shape=dict(hidden_size=64, num_experts=4,
                                                num_experts_per_tok=2,
                                                moe_intermediate_size=32), tokens=(4,))
        assert moe["grouped_over_dense"], moe
        paths = gpu_bench.write(dict(engine=res), __import__("pathlib").Path({str(tmp_path)!r}))
        assert [p.name for p in paths] == ["gpu_bench.json"]
        print("ok")
    """)


def test_engine_without_tokenizer_names_what_it_needs():
    from paged_jax.sampling_params import SamplingParams

    eng = gpu_bench.engine_for(*gpu_bench.random_model(TINY_MODEL), TINY_ENGINE, "paged")
    with pytest.raises(ValueError, match="no tokenizer"):
        eng.add_request("a", "some text")
    with pytest.raises(ValueError, match="detokenize=True needs a tokenizer"):
        eng.add_request("b", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))
    eng.add_request("c", {"prompt_token_ids": [1, 2]},
                    SamplingParams(max_tokens=2, detokenize=False))
    assert eng.has_unfinished()
