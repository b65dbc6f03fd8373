"""Multi-LoRA: throughput with 1, 4 and 16 distinct adapters in one batch beside the base
model alone, and what loading an adapter costs.

    python -m experiments.lora [--rounds 5] [--tokens 32] [--batches 16 64]

Model: SmolLM2-135M-Instruct (the shipped GGUF) at LLM()'s defaults (dtype "auto": bfloat16
on a CPU with AVX-512 BF16, else float32); the adapters' slots in the model's dtype and the
delta on the C++ kernel (kernels/cpu_lora.py) where it builds. Adapters:
random LoRAs of rank 16 on all seven projections (q, k, v, o, gate, up, down), written as
PEFT folders (adapter_config.json + adapter_model.safetensors under PEFT's key names) and
read by the engine as a user's would be. What is built: vLLM's design, a fixed number of
device slots apart from the KV cache (paged_jax/lora/manager.py), not S-LoRA's adapter pages
in the KV pool.
Parts:
  throughput  per batch size B, one LLM(enable_lora=True, max_loras=16, max_lora_rank=16)
              serving B greedy requests of --tokens tokens each: all on the base model, or
              spread round robin over 1, 4 or 16 adapters; the sides alternated round by
              round (common.rotated), warmed until a pass builds no program. Targets (issue
              60): with 4 adapters in a batch of 16 >= 0.8x the base model's tok/s, with 16
              >= 0.7x, judged on the per-round ratios (common.target_verdict).
  load        ms to read an adapter from disk into host memory, and to write it into a
              device slot (the engine's own counters, lora/manager.py).
Writes results/lora.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from experiments import common
from paged_jax.serve.metrics import compiles

RANK, ADAPTERS = 16, (1, 4, 16)
TARGETS = {(16, 4): 0.8, (16, 16): 0.7}  # (batch, adapters) -> the bar over the base model


def write_adapter(folder: Path, config, seed: int, scale: float = 0.01) -> Path:
    """A random rank-RANK LoRA of every projection of `config`, as a PEFT folder (B's
    entries of standard deviation `scale`)."""
    from safetensors.numpy import save_file

    from paged_jax.lora.peft_folder import TARGETS as MODULES
    from paged_jax.lora.peft_folder import shapes

    rng, dims = np.random.default_rng(seed), shapes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for m in MODULES:
            kind = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{kind}.{m}"
            i, o = dims[m]
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((RANK, i)) / np.sqrt(i)
                                               ).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((o, RANK)) * scale
                                               ).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=RANK, lora_alpha=2 * RANK, target_modules=list(MODULES),
        bias="none", use_rslora=False, use_dora=False)))
    return folder


def prompts(n: int) -> list[str]:
    return [f"Question {i}: explain in a few words why item {i % 9} comes before {i % 5}."
            for i in range(n)]


def warm(llm, sides: dict, sp, most: int = 4) -> int:
    """Untimed passes of every side until one builds no program (at most `most`)."""
    for i in range(most):
        before = compiles().count
        for ps, loras in sides.values():
            llm.generate(ps, sp, use_tqdm=False, lora_request=loras)
        if compiles().count == before:
            return i + 1
    return most


def throughput(llm, loras: list, batch: int, tokens: int, rounds: int) -> dict:
    """Output tok/s of the base model alone and of 1 / 4 / 16 adapters in a batch."""
    from paged_jax import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ps = prompts(batch)
    sides = {"base": (ps, None)}
    sides |= {f"{k} adapters": (ps, [loras[i % k] for i in range(batch)]) for k in ADAPTERS}
    passes = warm(llm, sides, sp)
    built = compiles().count
    runs = common.alternated({name: functools.partial(
        llm.generate, ps, sp, use_tqdm=False, lora_request=loras) for name, (ps, loras)
        in sides.items()}, rounds, batch * tokens)
    ratios = {name: common.round_ratios(v, runs["base"]) for name, v in runs.items()
              if name != "base"}
    return dict(batch=batch, tokens=tokens, rounds=rounds, warm_up_passes=passes,
                programs_built_timed=compiles().count - built,
                tok_s={n: dict(median=statistics.median(v), spread=common.spread(v), runs=v)
                       for n, v in runs.items()},
                over_base={n: dict(median=statistics.median(v), runs=v)
                           for n, v in ratios.items()})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    args = ap.parse_args(argv)
    from paged_jax import LLM
    from paged_jax.lora import LoRARequest

    llm = LLM("smollm2", enable_lora=True, max_loras=max(ADAPTERS), max_lora_rank=RANK,
              max_num_seqs=max(args.batches), max_num_batched_tokens=1024, max_model_len=256)
    config = llm.llm_engine.model_config
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"lora{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}",
                                                                  config, i)))
                 for i in range(max(ADAPTERS))]
        parts = [throughput(llm, loras, b, args.tokens, args.rounds) for b in args.batches]
    stats = llm.llm_engine.runner.adapters.stats
    load = dict(disk_to_host_ms=1e3 * stats["load_s"] / max(1, stats["disk_loads"]),
                host_to_slot_ms=1e3 * stats["write_s"] / max(1, stats["slot_writes"]),
                disk_loads=stats["disk_loads"], slot_writes=stats["slot_writes"],
                evictions=stats["evictions"])
    payload = dict(model="smollm2", rank=RANK, design="fixed device slots (vLLM's)",
                   throughput=parts, load=load, targets=targets(parts))
    report(payload)
    payload["json"] = str(common.save_json("lora", payload))
    print(payload["json"])
    return payload


def targets(parts: list[dict]) -> dict:
    """Issue 60's throughput targets, by the one rule on the per-round ratios."""
    out = {}
    for p in parts:
        for (batch, k), bar in TARGETS.items():
            if p["batch"] == batch:
                v = common.target_verdict(p["over_base"][f"{k} adapters"]["runs"], bar)
                out[f"{k} adapters in a batch of {batch} over the base model"] = dict(
                    bar=bar, ratio=v["median"], worst=v["worst"], verdict=v["verdict"])
    return out


def report(payload: dict) -> None:
    for p in payload["throughput"]:
        print(f"batch {p['batch']} x {p['tokens']} tokens, {p['rounds']} rounds")
        for name, v in p["tok_s"].items():
            ratio = p["over_base"].get(name, {}).get("median")
            print(f"  {name:12s} {v['median']:8.1f} tok/s (spread {v['spread']:.1f})"
                  + (f"  {ratio:.2f}x base" if ratio else ""))
    ld = payload["load"]
    print(f"adapter load: disk -> host {ld['disk_to_host_ms']:.1f} ms, host -> slot "
          f"{ld['host_to_slot_ms']:.1f} ms")
    for name, t in payload["targets"].items():
        print(f"  {name}: {t['ratio']:.2f}x (worst {t['worst']:.2f}), bar {t['bar']}: "
              f"{t['verdict']}")


if __name__ == "__main__":
    main()
