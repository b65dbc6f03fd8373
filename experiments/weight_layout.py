"""Which way round the runtime form stores projection weights: the model's matmul chain on
XLA:CPU with every projection [out, in] (the runtime form: `linear` contracts x's last axis
with w's) against [in, out] (`x @ w`), alternating, per batch size.

    python -m experiments.weight_layout [--model smollm2] [--batches 1 16 64] [--rounds 7]

The chain is `experiments.bench.matmul_chain`: per layer q|k|v, o, gate|up and down
projections, then the head as the forward runs it; no attention, norms or sampling. Each
round times one call of each layout (after a warm-up call each); reports the median and
spread (half the range) of the rounds, the [in, out] time over the [out, in] time, and in how
many rounds [out, in] was the faster (paired: both ran in the same round). Writes
results/weight_layout.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax.numpy as jnp
import numpy as np

from experiments.bench import matmul_chain
from experiments.common import save_json, table
from paged_jax.models import load_model
from paged_jax.models.llama import prepare_params


def measure(params: dict, batches: list[int], rounds: int) -> list[dict]:
    out_in, head = matmul_chain(params)
    in_out, _ = matmul_chain(params, lambda x, w: x @ w)
    layers = params["layers"]
    flipped = [{k: jnp.asarray(np.asarray(v).T) if v.ndim == 2 else v for k, v in p.items()}
               for p in layers]
    embed = params["embed"]
    sides = {"[out, in]": (out_in, layers), "[in, out]": (in_out, flipped)}
    rows = []
    for b in batches:
        x = jnp.full((b, embed.shape[1]), 0.01, embed.dtype)
        for f, ws in sides.values():
            f(ws, head, x).block_until_ready()
        times = {k: [] for k in sides}
        for _ in range(rounds):
            for k, (f, ws) in sides.items():
                t = time.perf_counter()
                f(ws, head, x).block_until_ready()
                times[k].append(time.perf_counter() - t)
        for k, ts in times.items():
            rows.append(dict(batch=b, layout=k, ms=1e3 * statistics.median(ts),
                             spread_ms=1e3 * (max(ts) - min(ts)) / 2,
                             runs_ms=[1e3 * t for t in ts]))
        a, c = rows[-2], rows[-1]
        a["in_out_over_out_in"] = c["ms"] / a["ms"]
        a["separable"] = abs(c["ms"] - a["ms"]) > a["spread_ms"] + c["spread_ms"]
        # paired: the rounds in which [out, in] was the faster (a sign test's count)
        a["out_in_faster_rounds"] = sum(x < y for x, y in zip(*times.values(), strict=True))
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    _, params, _ = load_model(a.model)
    rows = measure(prepare_params(params), a.batches, a.rounds)
    print(table(rows, ["batch", "layout", "ms", "spread_ms", "in_out_over_out_in", "separable",
                      "out_in_faster_rounds"]))
    out = dict(model=a.model, rounds=a.rounds, rows=rows)
    out["json"] = str(save_json("weight_layout", out))
    return out


if __name__ == "__main__":
    main()
