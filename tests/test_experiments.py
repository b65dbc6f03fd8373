"""Every experiment's main() at a tiny scale: it runs, and writes sane JSON + PNG."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from experiments import (
    batch_under_budget,
    bench,
    block_size,
    common,
    latency_vs_rate,
    memory_breakdown,
    preemption,
    sampling_sharing,
    sliding_window_kv,
)


@pytest.fixture(autouse=True)
def tmp_results(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    return tmp_path


def load(payload: dict) -> dict:
    assert payload["png"].endswith(".png") and open(payload["png"], "rb").read(4) == b"\x89PNG"
    data = json.loads(open(payload["json"]).read())
    assert data["provenance"]["commit"]
    return data


def test_memory_breakdown():
    data = load(memory_breakdown.main(requests=8, scale=0.1))
    rows = {r["policy"]: r for r in data["rows"]}
    for r in rows.values():
        shares = [r[c] for c in ("token_states", "reserved_future", "internal_frag",
                                 "external_frag")]
        assert all(0 <= s <= 1 for s in shares) and math.isclose(sum(shares), 1, abs_tol=1e-6)
    assert rows["paged"]["token_states"] > rows["orca-max"]["token_states"]
    assert rows["paged"]["reserved_future"] == 0 and rows["paged"]["external_frag"] == 0


def test_latency_vs_rate():
    data = load(latency_vs_rate.main(requests=4, measured_requests=4, real_requests=0,
                                     policies=("paged", "orca-max"), fractions=(0.5, 2.0),
                                     datasets=("alpaca",)))
    modeled, measured = data["panels"]
    assert (modeled["clock"], measured["clock"]) == ("modeled", "measured")
    assert len(modeled["points"]) == 4 and len(measured["points"]) == 8
    for panel in data["panels"]:
        assert panel["capacity"] > 0
        assert all(p["normalized_latency"] > 0 and p["n"] == 4 for p in panel["points"])
        assert set(panel["sustainable"]["rate"]) == {"paged", "orca-max"}


def test_modeled_clock_is_deterministic_and_favours_bigger_batches():
    """On the modeled clock a run's latencies do not depend on machine speed (two runs agree
    exactly), and paging, which batches more in the same pool, finishes a burst sooner."""
    from experiments import serving as sv
    from paged_jax.study.cost_model import GpuCostModel
    from paged_jax.study.workloads import make_workload

    parts, cfg = sv.tiny_model(), {**sv.TINY, "num_kv_blocks": 33}
    items = make_workload("alpaca", 12, float("inf"), parts[2], 0, 1.0, cfg["max_model_len"])
    spans = {}
    for policy in ("paged", "orca-max"):
        runs = [sv.serve(sv.make_engine(parts, **cfg, reservation=policy), items,
                         cost=GpuCostModel()) for _ in range(2)]
        assert [t.finished for t in runs[0].timings] == [t.finished for t in runs[1].timings]
        spans[policy] = runs[0].span
    assert spans["paged"] < spans["orca-max"]


def test_batch_under_budget():
    data = load(batch_under_budget.main(requests=8, scale=0.1))
    rows = {r["policy"]: r for r in data["rows"]}
    assert rows["paged"]["peak_running"] >= rows["orca-max"]["peak_running"]
    assert all(r["output_tokens"] > 0 for r in rows.values())


def test_block_size():
    data = load(block_size.main(sizes=(16,), requests=4, datasets=("alpaca",), repeats=1))
    assert data["rows"][0]["block_size"] == 16 and data["rows"][0]["output_tokens_per_s"] > 0


def test_sampling_sharing():
    data = load(sampling_sharing.main(requests=3, widths=(2,), beam_requests=1))
    assert all(0 < r["saving"] < 1 for r in data["rows"]), data["rows"]


def test_preemption():
    data = load(preemption.main(sizes=(16,), requests=10, scale=0.5, repeats=1))
    modes = {r["mode"]: r for r in data["rows"]}
    assert set(modes) == {"recompute", "swap"}
    assert modes["recompute"]["preemptions"] > 0


def test_sliding_window_chat():
    """Multi-turn chat past the window with prefix caching on: both layouts give the same
    tokens, every later turn hits the cache in both, hybrid's hit rate keeps up with one
    group's while everything fits, and a pool a third of the workload evicts in both."""
    from experiments import sliding_window_chat as chat
    from experiments import sliding_window_engine as sw
    from paged_jax.models.testing import tiny_gemma3_config

    config = tiny_gemma3_config(sliding_window=512, max_position_embeddings=2048)
    data = chat.run(sw.layout_model(config, 2048, head_dim=16), occupancies=(0.5, 3.0),
                    rounds=2)
    rows = {r["occupancy"]: r for r in data["rows"]}
    assert all(r["same_tokens"] for r in rows.values())
    assert rows[0.5]["hit_ratio"] >= 0.95 and rows[0.5]["hit_rate_one"] > 0.5
    assert rows[3.0]["evicted_one"] > 0 and rows[3.0]["evicted_hybrid"] > 0
    assert data["targets"]["hit_ratio_met"] and len(data["saturation"]["tok_s_runs"]["hybrid"]) == 2


def test_sliding_window_kv():
    """Per-layer-group KV on a Gemma-shaped config: equal up to the window, less past it,
    never more; the bytes follow the block arithmetic."""
    from paged_jax.models.testing import tiny_gemma3_config

    config = tiny_gemma3_config(sliding_window=512, max_position_embeddings=8192)
    data = load(sliding_window_kv.main(block=16, config=config, budget_gib=2 / 1024,
                                       engine_contexts=(2048,), real=False, chat=False))
    held = {r["layout"]: r for r in data["held"]}
    # The engine holds what its pool's block arithmetic says (one group 2, hybrid 5 here),
    # at most one short of it at the lengths its sequences had when counted (the last one
    # may be growing when the pool runs out); never more than its pool holds.
    for r in held.values():
        assert r["arithmetic_held"] - 1 <= r["held"] <= r["arithmetic_held"] <= r["arithmetic"]
    assert data["targets"]["arithmetic_gap"] and "prompt_length_gap" in data["targets"]
    assert held["hybrid"]["held"] >= 2 * held["one group"]["held"] > 0
    assert held["hybrid"]["groups"] == 3 and "arithmetic_met" in data["targets"]
    rows = {r["context"]: r for r in data["rows"]}
    assert rows[512]["saving"] == 0 and 0 < rows[1024]["saving"] < rows[8192]["saving"] < 1
    # 3 layers, 2 local; 8192 tokens = 512 blocks; local layers keep 512 / 16 + 1 = 33.
    per_block_mib = 2 * 1 * 16 * 4 * 16 / 2**20
    assert rows[8192]["shared_MiB"] == pytest.approx(3 * 512 * per_block_mib)
    assert rows[8192]["grouped_MiB"] == pytest.approx((512 + 2 * 33) * per_block_mib)
    assert all(r["seqs_grouped"] >= r["seqs_shared"] for r in rows.values())


def test_bench_puts_every_side_on_the_same_rows():
    data = json.loads(open(bench.main(["--quick", "--sides", "ours", "ours-int4", "hf",
                                       "--rounds", "2"])["json"]).read())  # a table, no plot
    sides = {(e["row"], e["side"]) for e in data["rows"]}
    assert ("batch 16", "HF generate() bfloat16") in sides and ("prefix",
                                                                 "paged-jax float32") not in sides
    for e in data["rows"]:
        assert len(e["runs"]) == 2 and e["tok_s"] > 0 and e["limit_tok_s"] > 0
        assert e["agree_first16_with_ours"] >= 0
        # each of our sides beside its own precision's limit: int4's codes, not float32's
        want = {"paged-jax float32": "float32", "paged-jax int4": "int4"}.get(e["side"])
        assert want is None or e["limit_precision"] == want
    one = {w: lim["batch 1"]["bytes_per_token"] for w, lim in data["limits_by_precision"].items()}
    for lim in data["limits"].values():  # measured before and after the rounds: the higher
        assert lim["tok_s"] == max(lim["measured_tok_s"]) and len(lim["measured_tok_s"]) == 2
    assert one["int4"] < one["float32"] / 4
    mem = data["memory"]  # the least memory left free after a run, against the floor
    assert mem["min_available_mib"] > 0 and mem["starved"] == (mem["min_available_mib"] < 1024)
    assert data["provenance"]["cpu"] and data["provenance"]["versions"]["jax"]
    # the integer sides run the pages LLM()'s check chose beside int8 (the default side
    # then is exactly what LLM() runs)
    assert data["sides"]["paged-jax int4"]["kv_cache_dtype"] == (
        data["default_choice"]["kv_cache_dtype"] if data["default"] == "paged-jax int8"
        else "auto")


def test_a_limit_measured_slow_is_not_the_one_judged():
    before = {"batch 16": dict(kind="matmul chain", tok_s=304.0, step_ms=52.6)}
    after = {"batch 16": dict(kind="matmul chain", tok_s=515.0, step_ms=31.1)}
    got = bench.higher(before, after)["batch 16"]
    assert got["tok_s"] == 515.0 and got["step_ms"] == 31.1
    assert got["measured_tok_s"] == [304.0, 515.0]
    assert bench.higher(after, before)["batch 16"]["measured_tok_s"] == [515.0, 304.0]


def test_bench_flags_a_run_that_left_the_machine_without_free_memory(capsys):
    """memory_check reads the least MemAvailable after any run: under the floor (a peer's
    mapped weights read from disk again) it warns and the results file says starved."""
    runs = {"batch 1": {"a": [{"mem_available_mib": 5000}, {"mem_available_mib": 237}],
                        "b": [{"mem_available_mib": None}]}}
    got = bench.memory_check({"runs": runs})
    assert got == dict(min_available_mib=237, floor_mib=1024, starved=True)
    assert "237 MiB" in capsys.readouterr().out
    runs["batch 1"]["a"][1]["mem_available_mib"] = 4000
    assert not bench.memory_check({"runs": runs})["starved"]


def test_a_starved_bench_run_judges_no_bar():
    """Every bar of a run that left the machine without free memory says it is not a test,
    whatever its rounds would have said; the same rounds judged with memory to spare do."""
    table = [dict(row="batch 16", side=s, runs=[100.0 * f, 101.0 * f, 99.0 * f],
                  limit_tok_s=120.0) for s, f in (("paged-jax float32", 1.0),
                                                  ("paged-jax bfloat16", 2.0))]
    fed = bench.targets("smollm2", table, "paged-jax bfloat16", True)
    assert {t["verdict"] for t in fed} == {"met"}
    starved = bench.targets("smollm2", table, "paged-jax bfloat16", True, starved=True)
    assert [t["target"] for t in starved] == [t["target"] for t in fed]
    assert {t["verdict"] for t in starved} == {bench.STARVED}


def test_async_scheduling_alternates_its_sides():
    from experiments import async_scheduling

    data = async_scheduling.main(["--rounds", "2", "--tokens", "4", "--batches", "2"])
    assert {r["side"] for r in data["rows"]} == {"window 8", "sync", "async"}
    for r in data["rows"]:
        assert len(r["runs"]) == 2 and r["tok_s"] > 0 and 0 <= r["host_share"] < 1
        assert r["greedy_agree"] == 1.0  # the same tokens whichever way the steps run


def test_weight_layout_times_both_layouts_of_the_same_chain():
    from experiments import weight_layout

    data = weight_layout.main(["--batches", "2", "--rounds", "2"])
    assert [r["layout"] for r in data["rows"]] == ["[out, in]", "[in, out]"]
    assert all(len(r["runs_ms"]) == 2 and r["ms"] > 0 for r in data["rows"])
    assert data["rows"][0]["in_out_over_out_in"] > 0


def test_long_prompt_runs_both_caps_with_the_same_tokens():
    from experiments import long_prompt

    data = long_prompt.main(["--caps", "0", "32", "--long", "400", "--shorts", "4",
                             "--short-tokens", "40"])
    rows = {r["cap"]: r for r in data["rows"]}
    assert set(rows) == {0, 32} and rows[32]["same_tokens"]  # the cap moves timing only
    for r in rows.values():
        assert r["itl_p50"] > 0 and r["long_ttft"] > 0 and r["max_preemptions"] == 0
        # the short requests' ITL while the long prompt prefills, against before it came
        assert r["itl_during_over_before"] == pytest.approx(
            statistics.median(r["itl_during_over_before_runs"]))


def test_weight_quantization_reports_every_side_and_target():
    """--quick: SmolLM2 at batch 1, one round; float32, int8, int4 and bfloat16 (and
    llama.cpp where `make peers` built it) with bytes, speed, perplexity and agreement."""
    from experiments import weight_quantization

    data = json.loads(open(weight_quantization.main(["--quick"])["json"]).read())
    (res,) = data["models"]
    sides = {s["side"]: s for s in res["sides"]}
    assert {"float32", "int8", "int4", "bfloat16"} <= set(sides)
    assert sides["float32"]["identical"] == sides["float32"]["of"] == 16
    assert sides["int4"]["bytes_per_param"] < sides["int8"]["bytes_per_param"] < 1.2
    for s in sides.values():
        assert s["batch 1"]["tok_s"] > 0 and 1 < s["perplexity"] < 1000
    for t in data["targets"]:  # a verdict word each; "met" None only where it cannot fail
        word = t["verdict"].removesuffix(" (one run: no spread measured)")  # --quick: 1 round
        assert word in ("met", "not met", "not separable") or (
            word.startswith("cannot fail") and t["met"] is None), t


def test_int8_quality_is_judged_unless_it_kept_the_codes_weight_only():
    """'cannot fail' only where int8 holds the file's own bytes and multiplies float
    activations (its logits are float32's); with its activations quantized (W4A8 on the kept
    codes, the CPU kernel's way) the quality targets are judged, as they are on other bytes."""
    from experiments import weight_quantization as wq

    def res(bytes_int8: float, quantized: bool | None) -> dict:
        int8 = dict(side="int8", bytes_per_param=bytes_int8)
        if quantized is not None:
            int8["activations_quantized"] = quantized
        return dict(sides=[int8, dict(side="llama.cpp", bytes_per_param=0.718)])

    assert wq._kept_codes(res(0.718, False)) and wq._kept_codes(res(0.718, None))  # old files
    assert not wq._kept_codes(res(0.718, True)) and not wq._kept_codes(res(1.1, False))


def test_speculative_draft_runs_every_side_on_the_same_tokens():
    """SmolLM2 drafting for itself (every draft kept), one round, batch 1 and 2: the judged
    side and plain, greedy identity checked, the targets' verdicts, JSON and PNG."""
    from experiments import speculative_draft

    data = speculative_draft.main(["--target", "smollm2", "--draft", "smollm2", "--batches",
                                   "1", "2", "--ks", "4", "--quantizations", "int4",
                                   "--tokens", "8", "--rounds", "1", "--kv-mib", "64"])
    saved = json.loads(open(data["json"]).read())
    cells = saved["cells"]
    assert set(cells) == {"chat batch 1", "code-edit batch 1", "chat batch 2"}
    assert set(saved["ttft"]) == {"plain", speculative_draft.JUDGED}
    assert all(0 < t["seconds"] < 60 and len(t["runs"]) == 5 for t in saved["ttft"].values())
    assert set(cells["chat batch 1"]) == {"plain", speculative_draft.JUDGED}
    for cell in cells.values():
        for side in cell.values():
            assert side["tok_s"] > 0 and side["greedy_same_rounds"] == 1
            assert 1 <= side["warm_up_passes"] <= 4 and side["programs_built_timed"] >= 0
    assert cells["chat batch 1"][speculative_draft.JUDGED]["acceptance"] > 0
    assert data["targets"]["greedy identical"]["verdict"] == "met"
    assert open(data["png"], "rb").read(4) == b"\x89PNG"


def test_speculative_runs_every_side_on_the_same_tokens():
    """SmolLM2, one round, batch 1 and 2: plain and n-gram sides with their acceptance,
    greedy identity checked, the targets' verdicts, JSON and PNG."""
    from experiments import speculative

    data = speculative.main(["--model", "smollm2", "--batches", "1", "2", "--ks", "2", "3",
                             "--tokens", "12", "--rounds", "1", "--workloads", "code-edit",
                             "--kv-mib", "64"])  # three engines at once: small pools
    cells = json.loads(open(data["json"]).read())["cells"]
    assert set(cells) == {"code-edit batch 1", "code-edit batch 2"}
    assert set(cells["code-edit batch 1"]) == {"plain", "ngram 2", "ngram 3"}
    for cell in cells.values():
        for side in cell.values():
            assert side["tok_s"] > 0 and side["greedy_same_rounds"] == 1
    assert data["targets"]["greedy identical"]["verdict"] == "met"
    assert open(data["png"], "rb").read(4) == b"\x89PNG"


def test_moe_times_every_expert_path_on_the_same_tokens():
    """Batch 4, one round: every path's tok/s and the layer alone, the same tokens on every
    path, the router's load conserved, real models' active parameters, the target's verdict."""
    from experiments import moe

    data = moe.main(["--rounds", "1", "--batch", "4", "--tokens", "8"])
    saved = json.loads(open(data["json"]).read())
    assert saved["decode"]["same_tokens"] and saved["load"]["conserved"]
    assert set(saved["decode"]["tok_s"]) == set(saved["layer"]["ms"]) == set(moe.IMPLS)
    assert all(v < 1e-3 for v in saved["layer"]["max_abs_diff_vs_dense"].values())
    mixtral = saved["routing"]["token_level"]["Mixtral-8x7B"]
    assert round(mixtral["total_params"] / 1e9, 1) == 46.7  # the published counts
    assert round(mixtral["active_params"] / 1e9, 1) == 12.9
    assert "verdict" in saved["targets"]["grouped over dense at batch 4"]


def test_lora_times_every_adapter_mix_beside_the_base_model():
    """Batch 4, one round: the base model and 1 / 4 / 16 adapters (4 distinct at batch 4),
    each timed with no program built while timed; the adapters' load counters."""
    from experiments import lora

    data = lora.main(["--rounds", "1", "--tokens", "4", "--batches", "4"])
    part = json.loads(open(data["json"]).read())["throughput"][0]
    assert set(part["tok_s"]) == {"base", "1 adapters", "4 adapters", "16 adapters"}
    assert part["programs_built_timed"] == 0 and all(v["median"] > 0
                                                     for v in part["tok_s"].values())
    assert data["load"]["disk_loads"] == 4 and data["load"]["slot_writes"] >= 4


def cut_short(text: str) -> bool:
    """Whether `text` is a JSON document cut off before its end (what max_tokens does to a
    constrained output), not one that went wrong inside: parsing fails only at the end."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string")
    return False


def test_structured_outputs_measures_validity_speed_compile_and_ttft():
    """SmolLM2, one round, batch 1 and 2, short outputs: every section and target present,
    the same lengths on both speed sides (asserted inside), JSON and PNG."""
    from experiments import structured_outputs

    data = structured_outputs.main(["--models", "smollm2", "--speed-model", "smollm2",
                                    "--batches", "1", "2", "--rounds", "1", "--variants", "1",
                                    "--max-tokens", "64", "--ttft-runs", "2", "--ttft-repeats",
                                    "3", "--kv-mib", "64", "--peer", "none"])
    saved = json.loads(open(data["json"]).read())
    # Constrained, an output obeys its constraint or was cut by max_tokens (64 here): the
    # regexes and choices are far shorter, so all five obey; a JSON output that does not
    # must be a prefix of one (the parser fails only at its end), never text that went
    # wrong inside, as an unmasked or mis-masked step gives. (Its own validator, not ours.)
    v = saved["validity"]["smollm2"]
    kinds = {t.name: t.kind for t in structured_outputs.TASKS}
    assert v["outputs"] == 11 and v["valid"] + len(v["invalid"]) == 11
    assert all(v["per_task"][n] == 1.0 for n, kind in kinds.items() if kind != "json"), v
    for bad in v["invalid"]:
        assert kinds[bad["task"]] == "json" and cut_short(bad["text"]), bad
    assert [r["batch"] for r in saved["speed"]] == [1, 2]
    for r in saved["speed"]:
        assert r["tok_s"]["ours constrained"] > 0 and r["tok_s"]["ours unconstrained"] > 0
        assert r["mask_us_per_token"] > 0 and 0 < r["mask_share"] < 1
    assert set(saved["compile"]["per_constraint_ms"]) == {t.name for t in
                                                          structured_outputs.TASKS}
    assert set(saved["ttft"]["seconds"]) == {"unconstrained", "cached schema", "new schema"}
    assert len(saved["ttft"]["added_runs"]["new schema"]) == 2
    assert 0 < saved["ttft"]["new_schema_host_ms"]["median"] <= saved["ttft"][
        "new_schema_host_ms"]["max"]
    assert "valid smollm2" in saved["targets"] and "new schema <= 50 ms" in saved["targets"]
    assert open(data["png"], "rb").read(4) == b"\x89PNG"
