"""The engine on the Pallas kernels (interpret mode on CPU): every path the engine has gives the
reference backend's greedy tokens and seeded samples.

    decode windows (a while_loop around pallas_call), mixed prefill + decode ragged steps,
    chunked prefill, prefix-cache hits (full and partial blocks), n > 1 forks, beam search,
    recompute and swap preemption

A one-layer tiny random model and few short requests: every step shape compiles the kernels
in interpret mode, which is most of this module's time.
"""

from __future__ import annotations

import functools

import pytest

from paged_jax.engine import Engine, EngineConfig
from paged_jax.engine.beam_search import beam_search
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config
from paged_jax.sampling_params import BeamSearchParams, SamplingParams
from tests.engine_helpers import BASE, all_free, run, tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
PROMPTS = ["a", "two words", "a prompt that gets chunked", "mid length"]
# One engine shape for every test here (each new shape compiles the kernels anew), with a
# pool small enough that most workloads also preempt.
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=16, decode_window=4, max_model_len=64,
             num_kv_blocks=12)
pytestmark = pytest.mark.xdist_group("pallas")  # one worker: compiled shapes are reused


@functools.cache
def one_layer():
    c = tiny_config(num_layers=1)
    return c, random_params(c), byte_tokenizer()


def engine(**cfg) -> Engine:
    return Engine(*one_layer(), EngineConfig(**{**BASE, **cfg}))


def both(workload, **cfg) -> tuple[dict, dict]:
    """Runs `workload(engine)` on the reference and on the Pallas backend."""
    outs = []
    for backend in ("reference", "pallas"):
        eng = engine(**{**SMALL, **cfg, "backend": backend})
        outs.append(workload(eng))
        assert all_free(eng) and eng.refused_steps == 0, backend
    return outs[0], outs[1]


def staggered(eng) -> dict:
    """Two requests, then two more after two steps: prefill chunks meet running decodes; the
    last request samples two seeded children (an n > 1 fork)."""
    reqs = [(str(i), p, SAMPLED if i == 3 else GREEDY) for i, p in enumerate(PROMPTS)]
    for r in reqs[:2]:
        eng.add_request(*r)
    done = {}
    for _ in range(2):
        done |= {o.request_id: o for o in eng.step() if o.finished}
    return done | run(eng, reqs[2:])


def same_tokens(ref: dict, pal: dict) -> None:
    assert sorted(ref) == sorted(pal)
    for rid in ref:
        assert tokens(pal, rid) == tokens(ref, rid), rid


def test_windows_mixed_steps_chunked_prefill_and_forks():
    ref, pal = both(staggered)
    same_tokens(ref, pal)
    assert len({tuple(t) for t in tokens(pal, "3")}) > 1  # the children really differ


def test_prefix_cache_hits():
    shared = "shared prompt, two blocks. "

    def workload(eng):
        first = run(eng, [("warm", shared + "first one", GREEDY)])
        # Full-block and partial-block hits (the prompt ends inside a cached block).
        more = run(eng, [("q1", shared + "second", GREEDY), ("q2", shared + "first", GREEDY)])
        assert more["q1"].num_cached_tokens > 0 and more["q2"].num_cached_tokens > 0
        return first | more

    same_tokens(*both(workload, enable_prefix_caching=True))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(mode):
    def workload(eng):
        outs = run(eng, [(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)])
        assert eng.scheduler.num_preempted > 0, "the small cache should preempt"
        return outs

    same_tokens(*both(workload, preemption_mode=mode))


@pytest.mark.parametrize("kv", ["int8"])  # fp8: tests/test_kernels_quant.py
def test_quantized_caches(kv):
    """int8 / fp8 pages with their scales, read by the Pallas kernels as by the reference: a
    prefill step and decode windows (each new step shape compiles the kernels again)."""
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    same_tokens(*both(lambda eng: run(eng, [("0", PROMPTS[2], short), ("1", PROMPTS[1], short)]),
                      kv_cache_dtype=kv))


def test_beam_search():
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    ref, pal = both(lambda eng: beam_search(eng, "beam me up", params)[0])
    assert [s.tokens for s in pal.sequences] == [s.tokens for s in ref.sequences]


LOWER = """
import dataclasses

import jax
from kernels import paged_attention, ragged_paged_attention
from paged_jax.engine import batch as batch_lib
from paged_jax.engine import step as step_lib
from paged_jax.engine import verify as verify_lib
from paged_jax.engine import window as window_lib
from tests.cuda_lowering import cuda_lowering
from tests.test_engine_pallas import GREEDY, PROMPTS, SMALL, engine

for mod in (paged_attention, ragged_paged_attention):  # Triton, not the interpreter
    mod.use_interpret = lambda: False
for kv in ("auto", "fp8"):  # float pages, and fp8 bits with scales
    eng = engine(**{**SMALL, "backend": "pallas", "kv_cache_dtype": kv})
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(str(i), p, GREEDY)
    plan = eng.scheduler.schedule()
    batch, shape, _, _ = batch_lib.build_step(plan, eng.config, [0], 257, "pallas")
    batch = dataclasses.replace(batch, ops=batch_lib.build_ops(plan.ops, eng.config))
    rows, toks, wshape, _ = batch_lib.build_window(plan, eng.config, "pallas")
    rows, toks = jax.numpy.asarray(rows), jax.numpy.asarray(toks)  # eager: outside the context
    cfg = eng.runner.cfg
    with cuda_lowering():
        for trace in (
            lambda: step_lib.run_step.trace(eng.params, eng.state, batch, cfg=cfg, shape=shape),
            lambda: window_lib.decode_window.trace(eng.params, eng.state, rows, toks, batch.ops,
                                                   cfg=cfg, window=4, shape=wshape),
            # a verify step (speculative decoding) over the same batch: every token sampled
            lambda: verify_lib.run_verify.trace(eng.params, eng.state, batch, cfg=cfg,
                                                shape=dataclasses.replace(shape, verify=5)),
        ):
            text = trace().lower(lowering_platforms=("cuda",)).as_text().lower()
            assert "triton" in text, "the kernels were not lowered to Triton"
print("lowered")
"""


def test_engine_steps_lower_for_cuda():
    """A whole ragged step, a decode window and a verify step, kernels included, lower for
    CUDA on CPU: the Pallas -> Triton rules hold inside the engine's jitted programs
    (while_loop included). In a fresh process: no interpret-mode traces cached, no run-time
    shape checker."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LOWER], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "lowered" in out.stdout, out.stderr[-3000:]
