"""A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) read into the form
lora/weights.py writes into a slot: per target module, A [L, r, in] and B [L, out, r] with the
scale folded into B (alpha / r, or alpha / sqrt(r) with rslora). What the slots cannot hold
is refused with its name: DoRA, biases, embeddings or the LM head, saved modules, per-module
ranks, a rank above the engine's max_lora_rank, shapes that do not fit the base model."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from paged_jax.models.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter's weights: target -> (A [L, r, in], B [L, out, r] scaled), float32;
    layers it does not touch hold zeros."""

    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module of `config`."""
    e, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    return dict(q_proj=(e, q), k_proj=(e, kv), v_proj=(e, kv), o_proj=(q, e),
                gate_proj=(e, f), up_proj=(e, f), down_proj=(f, e))


def read_config(folder: Path, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a PEFT LoRA config, or a ValueError naming what is not supported."""
    path = folder / "adapter_config.json"
    if not path.exists():
        raise FileNotFoundError(f"no adapter_config.json in {folder} (a PEFT LoRA folder)")
    c = json.loads(path.read_text())
    refused = [("peft_type", c.get("peft_type", "LORA") != "LORA"),
               ("use_dora (DoRA)", bool(c.get("use_dora"))),
               (f"bias={c.get('bias')!r}", c.get("bias", "none") != "none"),
               ("modules_to_save", bool(c.get("modules_to_save"))),
               ("rank_pattern", bool(c.get("rank_pattern"))),
               ("alpha_pattern", bool(c.get("alpha_pattern")))]
    bad = [name for name, on in refused if on]
    if bad:
        raise ValueError(f"{folder}: LoRA adapters with {', '.join(bad)} are not supported")
    r, alpha = int(c["r"]), float(c.get("lora_alpha", c["r"]))
    if r > max_rank:
        raise ValueError(f"{folder}: rank {r} exceeds the engine's max_lora_rank={max_rank}")
    return r, alpha / (math.sqrt(r) if c.get("use_rslora") else r)


def load_peft(path: str | Path, config: ModelConfig, max_rank: int) -> Adapter:
    """The adapter at `path` for a model of `config` (module docstring)."""
    from safetensors.numpy import load_file  # here: the engine imports this module, and the
    # GPU machine's environment (make gpu-check) has no safetensors

    folder = Path(path)
    r, scale = read_config(folder, max_rank)
    tensors = load_file(folder / "adapter_model.safetensors")
    dims, n = shapes(config), config.num_layers
    out = {t: (np.zeros((n, r, i), np.float32), np.zeros((n, o, r), np.float32))
           for t, (i, o) in dims.items()}
    used = set()
    for key, value in tensors.items():
        m = KEY.search(key)
        if m is None or m.group(2) not in dims:
            raise ValueError(f"{folder}: {key!r} is not supported (LoRA on {', '.join(TARGETS)} "
                             "only: no embeddings, LM head or other modules)")
        layer, target, side = int(m.group(1)), m.group(2), m.group(3)
        i, o = dims[target]
        want = (r, i) if side == "A" else (o, r)
        if layer >= n or value.shape != want:
            raise ValueError(f"{folder}: {key!r} has shape {value.shape}, the model needs "
                             f"{want} in one of its {n} layers")
        arr = value.astype(np.float32) * (scale if side == "B" else 1.0)
        out[target][side == "B"][layer] = arr
        used.add(target)
    return Adapter(r, {t: w for t, w in out.items() if t in used})
