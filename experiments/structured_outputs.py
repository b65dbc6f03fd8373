"""Structured outputs (JSON schema, regex, choice) against unconstrained generation of the same
prompts and lengths, alternating in one run.

    python -m experiments.structured_outputs [--models qwen2.5-coder-0.5b qwen2.5-coder-1.5b]
        [--speed-model qwen2.5-coder-0.5b] [--batches 1 16 64] [--rounds 3] [--max-tokens 256]

Constraints: experiments/structured_tasks.py (6 JSON schemas with nested objects, enums,
arrays, number ranges and string patterns; 3 regexes; 2 choices), each asked for by a chat
prompt, greedy, LLM's defaults otherwise (vLLM's JSON whitespace rule: any between tokens).
  validity     every task x --variants prompts on each model: the share of outputs that
               parse and validate (jsonschema / re.fullmatch / membership, not our matcher);
               an output cut by max_tokens counts as invalid
  speed        --speed-model at each batch: the constrained requests, and the same prompts
               unconstrained with max_tokens = each constrained output's length (ignore_eos):
               the same tokens to generate. Each round runs an engine's two sides back to
               back (paired: the ratio constrained / unconstrained is taken per round, so
               the machine's drift between rounds cancels); output tok/s and ratios are
               medians over --rounds; the target's verdict is on the per-round ratios. Also
               the host's mask time per masked token and its share of the wall time. The
               limit is the unconstrained side (the mask can only add work).
  compile      each constraint compiled by a fresh compiler (no cache), first mask included;
               and the compiler's one-off tokenizer table (built in the background at engine
               start, engine/constraints.py)
  ttft         batch 1, max_tokens 1: unconstrained, a cached schema, a schema never seen
               before (a new one each run), back to back --ttft-repeats times per round;
               each constrained run's difference from the unconstrained run beside it, a
               round's median of them, --ttft-runs rounds; and the host's own time for a
               new schema (compile and first mask, as the engine counts them).
Peer: vLLM's CPU build (`make peers`; its default structured-output backend) on the same
prompts, both its sides timed in the same rotation, its unconstrained side on its own
constrained lengths, and the share of its constrained outputs that obey (--peer none: ours
only).
Writes results/structured_outputs.json and .png (--parts, a subset of validity / speed / ttft:
results/structured_outputs_<parts>.json).
"""

from __future__ import annotations

import argparse
import statistics
import time

from experiments import common
from experiments.structured_tasks import TASKS, fresh_schema, requests

BAR, NEW_SCHEMA_MS = 0.9, 50.0  # the issue's: >= 0.9x unconstrained; a new schema <= 50 ms
PARTS = ("validity", "speed", "ttft")


def ids_of(tok, pairs) -> list[list[int]]:
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t.prompt(i)}],
                                               add_generation_prompt=True)) for t, i in pairs]


def ours(llm):
    """paged-jax's generate(prompts, max_tokens list, constraints list) -> (seconds, token
    lists, texts): greedy; an unconstrained prompt runs exactly its max_tokens."""
    from paged_jax import SamplingParams

    def gen(ids, most, constraints):
        sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=c is None,
                              structured_outputs=c) for n, c in zip(most, constraints,
                                                                    strict=True)]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], sps, use_tqdm=False)
        return (time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs],
                [o.outputs[0].text for o in outs])
    return gen


def vllm(worker):
    """The same for vLLM's CPU build (experiments/peer_vllm.py's "generate")."""
    def gen(ids, most, constraints):
        got = worker.call("generate", prompts=ids, max_tokens=most, constraints=constraints)
        return got["seconds"], got["tokens"], got["texts"]
    return gen


def validity(llm, tok, variants: int, max_tokens: int) -> dict:
    pairs = requests(len(TASKS) * variants)
    _, toks, texts = ours(llm)(ids_of(tok, pairs), [max_tokens] * len(pairs),
                               [t.constraint for t, _ in pairs])
    return judged(pairs, texts) | dict(mean_tokens=statistics.mean(map(len, toks)))


def judged(pairs, texts: list[str]) -> dict:
    """The share of outputs that obey their task's constraint, per task and overall."""
    per: dict[str, list[bool]] = {}
    bad = []
    for (t, _), text in zip(pairs, texts, strict=True):
        per.setdefault(t.name, []).append(t.valid(text))
        if not per[t.name][-1]:
            bad.append(dict(task=t.name, text=text))
    ok = sum(map(sum, per.values()))
    return dict(outputs=len(pairs), valid=ok, rate=ok / len(pairs), invalid=bad[:10],
                per_task={k: sum(v) / len(v) for k, v in per.items()})


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def sides(name: str, gen, pairs, ids, max_tokens: int) -> tuple[dict, list[str]]:
    """One engine's two timed sides: its constrained requests, and the same prompts
    unconstrained with max_tokens = each constrained output's length (the same tokens to
    generate). Each runs once untimed first (the constrained run fixes the lengths); a timed
    run returns (seconds, tokens). Also the constrained texts."""
    n = len(ids)
    cons = [t.constraint for t, _ in pairs]
    _, toks, texts = gen(ids, [max_tokens] * n, cons)
    lengths = [len(t) for t in toks]

    def run(most, constraints):
        s, got, _ = gen(ids, most, constraints)
        assert [len(t) for t in got] == lengths, name  # greedy: the same every time
        return s, sum(lengths)

    out = {"constrained": lambda: run([max_tokens] * n, cons),
           "unconstrained": lambda: run(lengths, [None] * n)}
    out["unconstrained"]()
    return out, texts


def paired_rounds(engines: dict, rounds: int) -> tuple[dict, dict]:
    """Each round runs each engine's two sides back to back (which goes first alternates by
    round; which engine goes first rotates), so a round's ratio constrained / unconstrained
    compares two neighbouring runs: the machine's slow drift, which moves both, cancels.
    Returns each side's tok/s runs and each engine's per-round ratios."""
    runs = {f"{e} {side}": [] for e in engines for side in ("constrained", "unconstrained")}
    ratios: dict[str, list[float]] = {e: [] for e in engines}
    for r in range(rounds):
        for e in common.rotated(list(engines), r):
            got = {}
            for side in ("constrained", "unconstrained")[::1 if r % 2 == 0 else -1]:
                s, total = engines[e][side]()
                got[side] = total / s
                runs[f"{e} {side}"].append(got[side])
            ratios[e].append(got["constrained"] / got["unconstrained"])
    return runs, ratios


def with_mask_time(run, mask: dict):
    """`run`, adding the host's mask time and count inside it, and its wall time, to `mask`."""
    from paged_jax.sample.grammar import STATS

    def go():
        s0, n0 = STATS.mask_seconds, STATS.masks
        s, total = run()
        mask["seconds"] += STATS.mask_seconds - s0
        mask["masks"] += STATS.masks - n0
        mask["wall"] += s
        return s, total
    return go


def speed(llm, tok, batch: int, rounds: int, max_tokens: int, worker=None) -> dict:
    pairs = requests(batch)
    ids = ids_of(tok, pairs)
    engines, peer = {}, {}
    engines["ours"], texts = sides("ours", ours(llm), pairs, ids, max_tokens)
    mask = dict(seconds=0.0, masks=0, wall=0.0)
    engines["ours"]["constrained"] = with_mask_time(engines["ours"]["constrained"], mask)
    if worker is not None:
        engines["vLLM"], peer_texts = sides("vLLM", vllm(worker), pairs, ids, max_tokens)
        peer = dict(peer_valid=judged(pairs, peer_texts)["rate"])
    runs, ratios = paired_rounds(engines, rounds)
    return dict(batch=batch, runs=runs, tok_s={n: statistics.median(v) for n, v in runs.items()},
                round_ratios=ratios, ratio={e: statistics.median(v) for e, v in ratios.items()},
                vs_bar=common.target_verdict(ratios["ours"], BAR),
                unpaired_vs_bar=common.compare(runs["ours constrained"],
                                               [BAR * x for x in runs["ours unconstrained"]]),
                valid=judged(pairs, texts)["rate"],
                mask_us_per_token=1e6 * mask["seconds"] / max(1, mask["masks"]),
                mask_share=mask["seconds"] / mask["wall"]) | peer


def compile_times(tok, vocab_size: int) -> dict:
    from paged_jax.sample.grammar import Grammars, fill_masks
    from paged_jax.sampling_params import StructuredOutputsParams

    # a compiler of its own: its cache is empty, so every constraint compiles
    s, g = timed(lambda: Grammars(tok.backend.to_str(), vocab_size, tok.eos_token_ids))
    out = {"tokenizer_table_s": s, "per_constraint_ms": {}}
    for t in TASKS:
        spec = StructuredOutputsParams(**t.constraint)
        s, _ = timed(lambda spec=spec: fill_masks([(g.matcher(g.compile(spec)), 0, [])], 1,
                                                  vocab_size, tok.eos_token_ids))
        out["per_constraint_ms"][t.name] = 1e3 * s
    out["max_ms"] = max(out["per_constraint_ms"].values())
    return out


def ttft(llm, tok, runs: int, repeats: int) -> dict:
    """Batch 1, max_tokens 1, `runs` rounds of `repeats` repeats; a repeat times every side
    once, back to back in a rotating order. A constrained side's difference is taken per
    repeat against the unconstrained run beside it (one TTFT here strays by tens of ms, and
    the machine drifts between repeats), and a round keeps the median of its differences.
    Beside the wall clock, what the host spends on a new schema (compile + first mask)."""
    from paged_jax import SamplingParams
    from paged_jax.sample.grammar import STATS

    ids = ids_of(tok, requests(1))[0]
    cached = TASKS[0].constraint
    sides = {"unconstrained": lambda i: None, "cached schema": lambda i: cached,
             "new schema": lambda i: {"json": fresh_schema(i)}}
    got = {n: [] for n in sides}
    diff = {n: [] for n in sides if n != "unconstrained"}
    host_ms = []
    fresh = iter(range(10 ** 6))  # every new-schema request gets a schema never seen before
    for i in range(runs + 1):  # the first round compiles the prefill shapes (not kept)
        one = {n: [] for n in sides}
        for j in range(repeats):
            for n in common.rotated(list(sides), i + j):
                sp = SamplingParams(temperature=0.0, max_tokens=1,
                                    structured_outputs=sides[n](next(fresh)))
                before = STATS.compile_seconds + STATS.mask_seconds
                s, _ = timed(lambda sp=sp: llm.generate([{"prompt_token_ids": ids}], sp,
                                                        use_tqdm=False))
                one[n].append(s)
                if i and n == "new schema":
                    host_ms.append(1e3 * (STATS.compile_seconds + STATS.mask_seconds - before))
        if i:
            for n, v in one.items():
                got[n].append(statistics.median(v))
            for n in diff:
                diff[n].append(statistics.median(
                    1e3 * (a - b) for a, b in zip(one[n], one["unconstrained"], strict=True)))
    plain = got["unconstrained"]
    return dict(seconds={n: statistics.median(v) for n, v in got.items()}, runs=got,
                repeats=repeats, added_ms={n: statistics.median(v) for n, v in diff.items()},
                added_runs=diff, new_schema_host_ms=dict(
                    median=statistics.median(host_ms), max=max(host_ms)),
                new_schema=common.target_verdict(diff["new schema"], NEW_SCHEMA_MS, False),
                cached_schema=common.target_verdict(diff["cached schema"], 0.0, False),
                cached_vs_unconstrained=common.compare(plain, got["cached schema"]))


def make(parts, a):
    from paged_jax import LLM

    return LLM(model_parts=parts, enable_prefix_caching=False, max_num_seqs=max(a.batches),
               max_num_batched_tokens=512, max_model_len=1024, kv_cache_memory=a.kv_mib << 20)


def parse(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    ap.add_argument("--speed-model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", type=int, default=4, help="prompts per task (validity)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ttft-runs", type=int, default=5, help="TTFT rounds")
    ap.add_argument("--ttft-repeats", type=int, default=9,
                    help="TTFT runs of each side per round (a round keeps the median difference)")
    ap.add_argument("--kv-mib", type=int, default=1024)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                    help="sections to run (a subset writes structured_outputs_<parts>.json)")
    ap.add_argument("--peer", choices=["vllm", "none"], default="vllm",
                    help="vLLM's CPU build beside ours in the speed rows (`make peers`)")
    return ap.parse_args(argv)


def peer(a, model: str):
    """vLLM's worker on the speed model (None when not asked for or not installed)."""
    from experiments.bench import ROOT, _installed
    from experiments.peer_protocol import Worker

    python = ROOT / ".venv-vllm" / "bin" / "python"
    if a.peer != "vllm" or not _installed(python, "vllm"):
        return None
    import os

    return Worker([str(python), str(ROOT / "experiments/peer_vllm.py"), "--model", model,
                   "--max-seqs", str(max(a.batches)), "--max-len", "1024",
                   "--kv-gib", str(max(1, a.kv_mib >> 10))],
                  env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT))


def main(argv: list[str] | None = None) -> dict:
    import gc

    from paged_jax.models import load_model

    a = parse(argv)
    out: dict = dict(models=a.models, speed_model=a.speed_model, batches=a.batches,
                     rounds=a.rounds, max_tokens=a.max_tokens, variants=a.variants,
                     parts=a.parts, validity={}, speed=[])
    models = a.models if "validity" in a.parts else []
    for name in dict.fromkeys([a.speed_model, *models]):
        parts = load_model(name)
        llm, tok = make(parts, a), parts[2]
        if name in models:
            out["validity"][name] = v = validity(llm, tok, a.variants, a.max_tokens)
            print(f"{name}: {v['valid']}/{v['outputs']} valid, per task {v['per_task']}",
                  flush=True)
        if name == a.speed_model and "speed" in a.parts:
            speed_part(llm, tok, parts[0].vocab_size, a, out)
        if name == a.speed_model and "ttft" in a.parts:
            out["ttft"] = t = ttft(llm, tok, a.ttft_runs, a.ttft_repeats)
            print(f"ttft: {t['seconds']}, added ms {t['added_ms']}, new schema's host ms "
                  f"{t['new_schema_host_ms']}", flush=True)
        del llm, parts
        gc.collect()
    out["targets"] = targets(out)
    for k, v in out["targets"].items():
        print(f"target {k}: {v}")
    name = "structured_outputs" + ("" if set(a.parts) == set(PARTS) else "_" + "_".join(a.parts))
    out["json"] = str(common.save_json(name, out))
    out["png"] = str(plot(out, name)) if out["speed"] else None
    return out


def speed_part(llm, tok, vocab_size: int, a, out: dict) -> None:
    """Compile times, then every batch's speed row (ours and the peer's), into `out`."""
    out["compile"] = compile_times(tok, vocab_size)
    print(f"compile: {out['compile']}", flush=True)
    worker = peer(a, a.speed_model)
    out["peer"] = None if worker is None else dict(
        name="vLLM (CPU build)", versions=worker.versions, settings=worker.settings)
    for b in a.batches:
        out["speed"].append(row := speed(llm, tok, b, a.rounds, a.max_tokens, worker))
        print(f"batch {b}: " + ", ".join(f"{n} {v:.1f}" for n, v in row["tok_s"].items())
              + f" tok/s; constrained / unconstrained {row['ratio']} "
              f"({row['vs_bar']['verdict']} vs {BAR}x), mask "
              f"{row['mask_us_per_token']:.0f} us/token, "
              f"{100 * row['mask_share']:.1f}% of wall", flush=True)
    if worker is not None:
        worker.close()


def targets(out: dict) -> dict:
    """The issue's: every output valid on every model; constrained >= 0.9x unconstrained at
    batch 16 and 64 (per-round ratios); a new schema adds <= 50 ms to TTFT and a cached one
    nothing (<= 0 ms) (per-round differences): each by the one rule (common.target_verdict:
    met when the worst round clears the bar, not met when the best round misses it)."""
    t = {f"valid {m}": dict(rate=v["rate"], verdict="met" if v["rate"] == 1 else "not met")
         for m, v in out["validity"].items()}
    for row in out["speed"]:
        if row["batch"] in (16, 64):
            t[f"batch {row['batch']} >= {BAR}x"] = dict(
                ratio=row["ratio"]["ours"], verdict=row["vs_bar"]["verdict"])
    if "ttft" in out:
        t[f"new schema <= {NEW_SCHEMA_MS:.0f} ms"] = dict(
            added_ms=out["ttft"]["added_ms"]["new schema"],
            verdict=out["ttft"]["new_schema"]["verdict"])
        c = out["ttft"]["cached_schema"]  # its per-round differences against 0
        t["cached schema adds nothing measurable"] = dict(
            added_ms=c["median"], rounds_ms=c["runs"], verdict=c["verdict"])
    return t


def plot(out: dict, name: str = "structured_outputs"):
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(out["speed"]))
    names = list(out["speed"][0]["tok_s"])
    w = 0.8 / len(names)
    for j, side in enumerate(names):
        ax.bar([x + w * j for x in xs], [r["tok_s"][side] for r in out["speed"]], w,
               label=side)
    ax.set_xticks([x + 0.4 - w / 2 for x in xs], [f"batch {r['batch']}" for r in out["speed"]])
    ax.set_ylabel(f"output tok/s ({out['speed_model']})")
    ax.legend()
    return common.save_plot(name, fig)


if __name__ == "__main__":
    main()
