"""On-disk cache of loaded (dequantized, cast) params, written with orbax-checkpoint.

An entry is keyed by the source files' fingerprint: sha256 over each file's name, size, first
MiB and last MiB. That reads 2 MiB per file instead of hashing gigabytes; it misses edits that
keep the size and both ends intact (re-quantizing or re-saving a model changes them), and it
survives copies and touches (no mtime). The key also holds the dtype and `FORMAT_VERSION`
(bump it when the params layout changes). Root: $PAGED_JAX_CACHE or ~/.cache/paged_jax.

    <root>/<stem>-<key16>-<dtype>/  params/ (orbax)  config.json  tokenizer.json
                                    tokenizer_meta.json
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.typing import DTypeLike

from paged_jax.compile_cache import cache_root
from paged_jax.models.config import ModelConfig
from paged_jax.models.llama import Params
from paged_jax.models.tokenizer import Tokenizer, load_saved_tokenizer, save_tokenizer

FORMAT_VERSION = 1
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
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore((entry / "params").absolute())
    params = jax.tree.map(jnp.asarray, params)
    return config, params, load_saved_tokenizer(entry)


def save_entry(entry: Path, config: ModelConfig, params: Params, tok: Tokenizer) -> None:
    """Writes an entry atomically: built in a temporary folder, then renamed into place."""
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save((tmp / "params").absolute(), params)
        ckpt.wait_until_finished()
    save_tokenizer(tok, tmp)
    (tmp / "config.json").write_text(config.to_json())  # written last: marks a whole entry
    try:
        tmp.rename(entry)
    except OSError:  # another process finished first; its entry is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
