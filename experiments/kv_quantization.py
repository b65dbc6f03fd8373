"""KV-cache quantization on SmolLM2-135M: which scale granularity (first part of the issue's
experiment; memory, quality and speed per kv_cache_dtype follow with the engine integration).

    python -m experiments.kv_quantization

Real K/V: the prompt is prefilled through the paged runner and every layer's K and V are read
back from the cache (post-RoPE, as attention sees them). For each dtype (int8, fp8 e4m3) and
granularity (one scale per token and KV head, or per block and KV head) it reports the mean
relative error of K, of V and of causal attention outputs against the fp32 cache, with the
sequence's own keys as queries (a proxy: the runner does not expose queries), averaged over
layers. Writes results/kv_quantization.json.
"""

from __future__ import annotations

import numpy as np

from experiments.common import save_json, table
from paged_jax.config import CacheConfig
from paged_jax.kv_cache import gather_sequence
from paged_jax.kv_quant import measure_granularity
from paged_jax.models import load_model
from paged_jax.models.runner import Runner
from paged_jax.workloads import TEXT

BLOCK = 16


def granularity(tokens: int = 256) -> list[dict]:
    config, params, tok = load_model()
    ids = (tok.encode(TEXT) * 8)[:tokens]
    runner = Runner(config, params, CacheConfig(tokens // BLOCK + 2, BLOCK, 1, tokens // BLOCK + 1))
    runner.step([ids])
    per_layer = []
    for layer in range(config.num_layers):
        k, v = (np.asarray(x) for x in gather_sequence(runner.cache, layer, runner.table, 0))
        q = np.repeat(k, config.num_heads // config.num_kv_heads, axis=1)
        per_layer.append(measure_granularity(k, v, q, BLOCK))
    rows = []
    for i, row in enumerate(per_layer[0]):
        vals = [layer[i] for layer in per_layer]
        rows.append({**{k: row[k] for k in ("dtype", "granularity")},
                     **{m: float(np.mean([x[m] for x in vals]))
                        for m in ("k_rel_err", "v_rel_err", "attn_rel_err")}})
    return rows


def main(tokens: int = 256, name: str = "kv_quantization") -> dict:
    rows = granularity(tokens)
    payload = dict(config=dict(tokens=tokens, block_size=BLOCK, model="SmolLM2-135M-Instruct",
                               queries="the sequence's own keys (proxy)"), granularity=rows)
    payload["json"] = str(save_json(name, payload))
    print(table(rows, ["dtype", "granularity", "k_rel_err", "v_rel_err", "attn_rel_err"]))
    return payload


if __name__ == "__main__":
    main()
