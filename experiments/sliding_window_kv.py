"""How much KV a per-layer-group pool would save on Gemma 3's sliding-window layers.

    python -m experiments.sliding_window_kv [--model gemma3] [--budget-gib 1]

paged-jax keeps one page table per sequence shared by every layer (vLLM's first paged
design): a sequence of L tokens holds ceil(L / block) blocks in each of the model's layers.
A sliding-window layer only ever reads the last `window` keys, so in a per-layer-group pool
(vLLM V1's hybrid KV cache manager) the local layers would hold at most
ceil(window / block) + 1 blocks per sequence (the window straddles a block edge) and free the
rest; full-attention layers keep everything. This script computes both from the model's
config (no weights are loaded) for contexts from 256 to the model's limit, and the sequences
of each length a fixed KV budget holds. The trade-off is in docs/architecture.md.
"""

from __future__ import annotations

import argparse
import math

from experiments.common import pyplot, save_json, save_plot, table
from paged_jax.models.config import ModelConfig
from paged_jax.models.gguf_loader import config_from_gguf

CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def gemma3_config() -> ModelConfig:
    """The shipped Gemma 3 270M's config, from its GGUF's metadata only."""
    import gguf

    from paged_jax.models import model_path

    reader = gguf.GGUFReader(str(model_path("gemma3")))
    fields = reader.fields
    meta = {k: f.contents() for k, f in fields.items() if not k.startswith(("GGUF.", "tok"))}
    # Only the vocabulary's size is needed: decoding 262k token strings would take 25 s.
    meta["tokenizer.ggml.tokens"] = [None] * len(fields["tokenizer.ggml.tokens"].data)
    return config_from_gguf(meta, {t.name: t for t in reader.tensors})


def blocks_per_sequence(config: ModelConfig, context: int, block: int) -> dict:
    """Blocks summed over layers: one shared table vs per-layer-group tables."""
    held = math.ceil(context / block)
    cap = math.ceil((config.sliding_window or context) / block) + 1
    local = sum(config.window(i) is not None for i in range(config.num_layers))
    return dict(shared=config.num_layers * held,
                grouped=(config.num_layers - local) * held + local * min(held, cap))


def main(block: int = 16, budget_gib: float = 1.0, name: str = "sliding_window_kv",
         config: ModelConfig | None = None) -> dict:
    config = config or gemma3_config()
    per_block = 2 * config.num_kv_heads * config.head_dim * 4 * block  # fp32 K + V, one layer
    budget = budget_gib * 2**30
    rows = []
    for ctx in (c for c in CONTEXTS if c <= config.max_position_embeddings):
        b = blocks_per_sequence(config, ctx, block)
        rows.append(dict(context=ctx, shared_MiB=b["shared"] * per_block / 2**20,
                         grouped_MiB=b["grouped"] * per_block / 2**20,
                         saving=1 - b["grouped"] / b["shared"],
                         seqs_shared=int(budget // (b["shared"] * per_block)),
                         seqs_grouped=int(budget // (b["grouped"] * per_block))))
    print(table(rows, ["context", "shared_MiB", "grouped_MiB", "saving", "seqs_shared",
                       "seqs_grouped"]))
    payload = dict(config=dict(model=config.architecture, layers=config.num_layers,
                               sliding_layers=sum(config.window(i) is not None
                                                  for i in range(config.num_layers)),
                               window=config.sliding_window, block_size=block,
                               budget_gib=budget_gib, kv_dtype="float32"), rows=rows)
    payload["json"], payload["png"] = str(save_json(name, payload)), str(plot(rows, name))
    return payload


def plot(rows: list[dict], name: str):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 3.2))
    xs = [r["context"] for r in rows]
    ax.plot(xs, [r["shared_MiB"] for r in rows], "o-", label="one table for all layers (built)")
    ax.plot(xs, [r["grouped_MiB"] for r in rows], "s-", label="per-layer-group tables")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("KV per sequence (MiB, fp32)")
    ax.set_title("Gemma 3 270M: KV held by one sequence", fontsize=9)
    ax.legend(fontsize=7)
    return save_plot(name, fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--budget-gib", type=float, default=1.0)
    a = ap.parse_args()
    main(block=a.block, budget_gib=a.budget_gib)
