"""LoRA adapters through the engine (paged_jax/lora, engine/admission.adapter_fits, the
prefix cache's salt): a mixed batch gives each row the tokens it gets alone and PEFT's greedy
tokens; more adapters than slots wait and are served; a prefix-cache hit never crosses
adapters; no program is built after warm-up as the mix of adapters changes; bad requests
are refused with their reason."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from paged_jax.engine import Engine, EngineConfig
from paged_jax.engine.beam_search import beam_search
from paged_jax.engine.programs import PROGRAMS
from paged_jax.lora import LoRARequest
from paged_jax.lora.config import LoRAConfig
from paged_jax.models.safetensors_loader import load_safetensors
from paged_jax.sampling_params import BeamSearchParams, SamplingParams
from tests.lora_helpers import ADAPTERS, hf_model, merged_model, peft_greedy, random_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
PROMPTS = [[5, 17, 3, 44, 8, 9, 1, 70, 22], [60, 2, 2, 31, 7], [11, 12, 13, 14, 15, 16, 17],
           [90, 4, 33, 35, 36, 37, 38, 39, 40, 41, 42, 43]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config, params, base folder, three LoRARequests) of a tiny random Llama."""
    folder = tmp_path_factory.mktemp("lora")
    model = hf_model(folder / "base")
    paths = [random_adapter(model, folder / f"a{i}", *spec, seed=i + 1)
             for i, spec in enumerate(ADAPTERS)]
    config, params = load_safetensors(folder / "base")
    return config, params, folder / "base", [LoRARequest(f"a{i}", i + 1, str(p))
                                              for i, p in enumerate(paths)]


def lora_engine(tiny, max_loras: int = 3, **kw) -> Engine:
    config, params = tiny[:2]
    ec = EngineConfig(**{**dict(block_size=8, num_kv_blocks=80, max_num_seqs=4,
                                max_num_batched_tokens=64, max_model_len=128,
                                lora=LoRAConfig(max_loras, 8)), **kw})
    return Engine(config, params, None, ec)


def serve(eng: Engine, reqs: list[tuple]) -> dict:
    """(id, prompt ids, LoRARequest | None) requests at once; id -> (tokens, cached)."""
    for rid, ids, lora in reqs:
        eng.add_request(rid, {"prompt_token_ids": ids}, GREEDY, lora_request=lora)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.num_cached_tokens)
    return done


def mixed(loras) -> list[tuple]:
    """Every prompt under the base model and under each adapter, interleaved."""
    return [(f"p{p}-{i}", ids, lora) for p, ids in enumerate(PROMPTS)
            for i, lora in enumerate([None, *loras])]


@pytest.fixture(scope="module")
def alone(tiny) -> dict:
    """Each request of `mixed` served by itself: id -> tokens."""
    eng = lora_engine(tiny)
    return {rid: serve(eng, [(rid, ids, lora)])[rid][0] for rid, ids, lora in mixed(tiny[3])}


def test_a_mixed_batch_gives_each_row_its_own_tokens_and_peft_s(tiny, alone):
    want = alone
    got = serve(lora_engine(tiny), mixed(tiny[3]))
    assert {rid: t for rid, (t, _) in got.items()} == want
    folders = [None, *(lora.lora_path for lora in tiny[3])]
    for p, ids in enumerate(PROMPTS[:2]):
        for i, folder in enumerate(folders):
            assert want[f"p{p}-{i}"] == peft_greedy(tiny[2], folder, ids, GREEDY.max_tokens)
    assert len({tuple(want[f"p0-{i}"]) for i in range(4)}) == 4, "adapters changed nothing"


def test_more_adapters_than_slots_wait_and_are_served(tiny, alone):
    eng = lora_engine(tiny, max_loras=1)
    got = serve(eng, mixed(tiny[3]))
    assert {rid: t for rid, (t, _) in got.items()} == alone
    assert eng.runner.adapters.stats["evictions"] > 0


def test_a_prefix_hit_never_crosses_adapters(tiny):
    eng = lora_engine(tiny)
    long = PROMPTS[3] + PROMPTS[0] + PROMPTS[2]  # 28 tokens: 3 full blocks
    a, b = tiny[3][:2]
    first = serve(eng, [("a", long, a)])
    again = serve(eng, [("a2", long, a)])
    other = serve(eng, [("b", long, b)])
    base = serve(eng, [("base", long, None)])
    assert again["a2"][1] >= 16 and again["a2"][0] == first["a"][0]
    assert other["b"][1] == 0 and base["base"][1] == 0


@pytest.mark.parametrize("mode", [dict(async_scheduling=True, decode_window=1),
                                  dict(async_scheduling=False, decode_window=4)],
                         ids=["async", "windows"])
def test_no_program_is_built_after_warm_up_as_the_adapter_mix_changes(tiny, mode):
    from paged_jax.compile_cache import clear_programs

    clear_programs()  # this process's earlier programs would count against its mapping limit
    # few buckets: with adapters every program comes twice (with and without deltas)
    eng = lora_engine(tiny, max_loras=2, max_num_seqs=2, max_num_batched_tokens=32, **mode)
    eng.warm_up("auto")
    built = PROGRAMS.built
    loras = tiny[3]
    serve(eng, mixed(loras[:1]))
    serve(eng, mixed(loras[1:]))  # other adapters: slots rewritten, evictions
    serve(eng, [(f"b{i}", ids, None) for i, ids in enumerate(PROMPTS)])
    assert eng.runner.adapters.stats["slot_writes"] >= 3
    assert PROGRAMS.built == built, "an adapter mix built a program warm-up did not"


def test_bad_lora_requests_are_refused_with_their_reason(tiny, tmp_path):
    lora = tiny[3][0]
    with pytest.raises(ValueError, match="enable_lora=True"):
        lora_engine(tiny, lora=None).add_request("x", {"prompt_token_ids": [1, 2]}, GREEDY,
                                                 lora_request=lora)
    eng = lora_engine(tiny, lora=LoRAConfig(1, 2))  # rank 2 slots: adapter a0 has rank 4
    with pytest.raises(ValueError, match="max_lora_rank=2"):
        eng.add_request("x", {"prompt_token_ids": [1, 2]}, GREEDY, lora_request=lora)
    eng = lora_engine(tiny)
    with pytest.raises(ValueError, match="already"):
        for i, path in enumerate((lora.lora_path, tiny[3][1].lora_path)):
            eng.add_request(f"y{i}", {"prompt_token_ids": [1]}, GREEDY,
                            lora_request=dataclasses.replace(lora, lora_path=path))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        eng.add_request("z", {"prompt_token_ids": [1]}, GREEDY,
                        lora_request=LoRARequest("missing", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="positive"):
        LoRARequest("zero", 0, str(tmp_path))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_and_forked_requests_keep_their_adapter(tiny, alone, mode):
    """A pool too small for the batch preempts (recompute or swap) requests of different
    adapters, and n = 2 forks children: every sequence still gets its own adapter's tokens."""
    eng = lora_engine(tiny, num_kv_blocks=9, preemption_mode=mode)
    reqs = [r for r in mixed(tiny[3]) if r[0].startswith(("p0-", "p3-"))]
    got = serve(eng, reqs)
    assert eng.scheduler.num_preempted > 0, "the pool was big enough: nothing was preempted"
    assert {rid: t for rid, (t, _) in got.items()} == {rid: alone[rid] for rid, *_ in reqs}
    # n = 2, seeded: both children run the adapter, alone or beside other adapters' rows
    two = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True,
                         detokenize=False)

    def children(others: list[tuple], lora) -> list[list[int]]:
        eng = lora_engine(tiny)
        for rid, ids, other in others:
            eng.add_request(rid, {"prompt_token_ids": ids}, GREEDY, lora_request=other)
        eng.add_request("n2", {"prompt_token_ids": PROMPTS[1]}, two, lora_request=lora)
        while eng.has_unfinished():
            for out in eng.step():
                if out.request_id == "n2" and out.finished:
                    found = [c.token_ids for c in out.outputs]
        return found

    mine = children([], tiny[3][2])
    assert children(mixed(tiny[3][:2])[:6], tiny[3][2]) == mine
    assert children([], None) != mine, "the children ran the base model"


def test_a_snapshot_mid_run_resumes_every_adapter_s_rows(tiny, alone, tmp_path):
    """engine/snapshot.py with adapters: the restoring engine's slots start empty and are
    filled again on demand from the requests' LoRARequests (no adapter state is saved)."""
    from paged_jax.engine import snapshot

    eng, reqs = lora_engine(tiny), mixed(tiny[3])
    for rid, ids, lora in reqs:
        eng.add_request(rid, {"prompt_token_ids": ids}, GREEDY, lora_request=lora)
    done = {o.request_id: o.outputs[0].token_ids for _ in range(3) for o in eng.step()
            if o.finished}
    snapshot.save(eng, tmp_path / "s")
    fresh = lora_engine(tiny)
    snapshot.restore(fresh, tmp_path / "s")
    done |= {rid: toks for rid, (toks, _) in serve(fresh, []).items()}
    assert done == alone


def test_beams_under_an_adapter_are_the_merged_model_s_beams(tiny, tmp_path):
    """Beam search under an adapter (every beam in the adapter's slot, forks included) finds
    the beams of the model with the adapter merged into its weights, not the base model's."""
    config, params, base, loras = tiny
    mconfig, mparams = load_safetensors(merged_model(base, Path(loras[0].lora_path),
                                                     tmp_path / "merged"))
    plain = Engine(mconfig, mparams, None, EngineConfig(
        block_size=8, num_kv_blocks=80, max_num_seqs=4, max_num_batched_tokens=64,
        max_model_len=128))
    bp = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    eng = lora_engine(tiny)
    ours, _ = beam_search(eng, prompt, bp, loras[0])
    want, _ = beam_search(plain, prompt, bp)
    assert [b.tokens for b in ours.sequences] == [b.tokens for b in want.sequences]
    np.testing.assert_allclose([b.cum_logprob for b in ours.sequences],
                               [b.cum_logprob for b in want.sequences], atol=1e-4)
    base_beams, _ = beam_search(eng, prompt, bp)  # the same engine, its slot now idle
    assert [b.tokens for b in base_beams.sequences] != [b.tokens for b in ours.sequences]
    with pytest.raises(ValueError, match="enable_lora"):
        beam_search(plain, prompt, bp, loras[0])


def test_structured_outputs_under_adapters_obey_and_keep_each_row_s_tokens(tmp_path):
    """Constrained requests under two adapters and the base model in one batch: each obeys
    its constraint and gets the tokens it gets alone; the adapters change what they say."""
    from experiments.lora import write_adapter
    from tests.engine_helpers import engine, model
    from tests.test_structured_outputs import constrained, obeys

    loras = [None] + [LoRARequest(f"s{i}", i + 1, str(
        write_adapter(tmp_path / f"s{i}", model()[0], seed=i, scale=0.5))) for i in range(2)]
    reqs = [(f"{kind} {j}", f"prompt for {kind}: ", constrained(kind, seed=3), lora)
            for kind in ("regex", "choice", "json") for j, lora in enumerate(loras)]

    def serve(batch: list) -> dict:
        eng = engine(lora=LoRAConfig(2, 16))
        for rid, prompt, sp, lora in batch:
            eng.add_request(rid, prompt, sp, lora_request=lora)
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.outputs[0] for o in eng.step() if o.finished})
        return done

    together = serve(reqs)
    for r in reqs:
        out = together[r[0]]
        assert obeys(r[0].split()[0], out.text), (r[0], out.text)
        assert serve([r])[r[0]].token_ids == out.token_ids, r[0]
    for kind in ("regex", "choice", "json"):
        assert len({together[f"{kind} {j}"].text for j in range(3)}) > 1, kind
