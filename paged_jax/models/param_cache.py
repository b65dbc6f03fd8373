"""On-disk cache of loaded (dequantized, cast) params, one safetensors file per entry.

An entry is keyed by the source files' fingerprint: sha256 over each file's name, size, first
MiB and last MiB. That reads 2 MiB per file instead of hashing gigabytes; it misses edits that
keep the size and both ends intact (re-quantizing or re-saving a model changes them), and it
survives copies and touches (no mtime). The key also holds the dtype and `FORMAT_VERSION`
(bump it when the params layout changes). Root: $PAGED_JAX_CACHE or ~/.cache/paged_jax.

    <root>/<stem>-<key16>-<dtype>/  params.safetensors  config.json  tokenizer.json
                                    tokenizer_meta.json

Why safetensors and not orbax-checkpoint (version 1 of this cache): SmolLM2-135M's 540 MB of
params restore in 0.7 s (read + one transfer) against orbax's 1.3 s, and the import is free
where orbax's costs 0.4 s: a fresh process's start is what this cache is for.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from safetensors.numpy import load_file, save_file

from paged_jax.compile_cache import cache_root
from paged_jax.models.config import ModelConfig
from paged_jax.models.llama import Params
from paged_jax.models.tokenizer import Tokenizer, load_saved_tokenizer, save_tokenizer

FORMAT_VERSION = 4  # 3: GGUF stop ids include end-of-generation control tokens; 4: lm_head [V, E]
_MIB = 1 << 20


def fingerprint(files: Sequence[Path]) -> str:
    """sha256 hex of each file's name, size, first and last MiB (module docstring)."""
    h = hashlib.sha256(f"v{FORMAT_VERSION}".encode())
    for path in sorted(Path(f) for f in files):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(_MIB))
            f.seek(max(0, size - _MIB))
            h.update(f.read(_MIB))
    return h.hexdigest()


def entry_dir(files: Sequence[Path], name: str, dtype: DTypeLike) -> Path:
    """The cache folder for params of `files` loaded in `dtype`."""
    return cache_root() / f"{name}-{fingerprint(files)[:16]}-{jnp.dtype(dtype).name}"


def load_entry(entry: Path) -> tuple[ModelConfig, Params, Tokenizer] | None:
    """The cached (config, params, tokenizer), or None when the entry is absent."""
    if not (entry / "config.json").is_file():
        return None
    config = ModelConfig.from_json((entry / "config.json").read_text())
    params = jax.device_put(_unflatten(load_file(entry / "params.safetensors")))
    return config, params, load_saved_tokenizer(entry)


def save_entry(entry: Path, config: ModelConfig, params: Params, tok: Tokenizer) -> None:
    """Writes an entry atomically: built in a temporary folder, then renamed into place."""
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(_flatten(jax.device_get(params)), tmp / "params.safetensors")
    save_tokenizer(tok, tmp)
    (tmp / "config.json").write_text(config.to_json())  # written last: marks a whole entry
    try:
        tmp.rename(entry)
    except OSError:  # another process finished first; its entry is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """Nested dicts of arrays -> {"layers/wq": array, ...} (the params are dicts only)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flatten(v, f"{prefix}{k}/")
        else:
            out[f"{prefix}{k}"] = np.ascontiguousarray(v)
    return out


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    out: dict = {}
    for key, v in flat.items():
        *path, name = key.split("/")
        node = out
        for p in path:
            node = node.setdefault(p, {})
        node[name] = v
    return out
