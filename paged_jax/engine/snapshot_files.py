"""A snapshot's folder (engine/snapshot.py): each part written by the writer measured faster
for it, and the whole committed by one rename.

    PATH/orbax/             orbax-checkpoint: "meta" (JSON: what the snapshot fits) and
                            "small" (the pool, page tables and sampling state, and the host
                            mirror's pickle as a uint8 array)
    PATH/pages.safetensors  the K/V pages (and a draft model's), each as its raw bytes

Why two writers: with a full 1 GiB pool (results/snapshot.json, experiments/snapshot.py)
safetensors wrote the pages faster than orbax and read them back several times faster (a
memory map and one copy to the device, where orbax's tensorstore path decompresses and
copies in chunks); orbax keeps what it is good at here, typed metadata and the small arrays,
at a cost of tens of milliseconds. Pages are stored as bytes (uint8) with their dtype and
shape in the metadata, so every KV dtype (bfloat16, int8, fp8) round-trips.

Atomic commit: everything is written into PATH.partial-<pid>-<n> and renamed to PATH only once
complete; a save cut short leaves a folder no restore mistakes for a snapshot.
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from safetensors.numpy import load_file, save_file

PAGES = "pages.safetensors"
_tmp_ids = itertools.count()


class SnapshotError(ValueError):
    """A snapshot that does not fit this engine, or cannot be read whole."""


def write(path: Path, meta: dict, small: dict[str, Any], pages: dict[str, jax.Array]) -> int:
    """Writes a snapshot folder at the new `path`; returns its bytes."""
    tmp = path.with_name(f"{path.name}.partial-{os.getpid()}-{next(_tmp_ids)}")
    try:
        tmp.mkdir(parents=True)
        raw = {k: np.asarray(x) for k, x in pages.items()}
        meta = {**meta, "pages": {k: [str(x.dtype), list(x.shape)] for k, x in raw.items()}}
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ck:
            ck.save(tmp / "orbax", args=ocp.args.Composite(
                meta=ocp.args.JsonSave(meta), small=ocp.args.StandardSave(small)))
        save_file({k: x.reshape(-1).view(np.uint8) for k, x in raw.items()}, str(tmp / PAGES))
        tmp.rename(path)  # the commit: a complete folder appears under its name, or nothing
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def read_meta(path: Path) -> dict:
    _check_folder(path)
    return _orbax(path, "meta", ocp.args.JsonRestore())


def read_small(path: Path, like: dict[str, jax.Array]) -> dict[str, Any]:
    """The small arrays, placed as `like`'s (and the host pickle, whatever its length)."""
    return _orbax(path, "small", ocp.args.StandardRestore(like))


def read_pages(path: Path, meta: dict, like: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The K/V pages, checked against `like`'s dtypes and shapes and placed as they are."""
    try:
        raw = load_file(str(path / PAGES))
        host = {k: raw[k].view(np.dtype(meta["pages"][k][0])).reshape(meta["pages"][k][1])
                for k in like}
    except Exception as e:  # truncated, altered or missing: nothing was installed yet
        raise SnapshotError(f"{path} is incomplete or corrupt: cannot read its K/V pages "
                            f"({type(e).__name__}: {e})") from e
    for k, x in like.items():
        if host[k].shape != x.shape or host[k].dtype != x.dtype:
            raise SnapshotError(f"{path}: page array {k} is {host[k].dtype}{host[k].shape}, "
                                f"this engine's {x.dtype}{x.shape}")
    return dict(zip(like, jax.device_put([host[k] for k in like],
                                         [x.sharding for x in like.values()]), strict=True))


def _check_folder(path: Path) -> None:
    if ".partial-" in path.name:
        raise SnapshotError(f"{path} is an unfinished save (its writer stopped before the "
                            "commit): no snapshot")
    if not (path / "orbax").is_dir() or not (path / PAGES).is_file():
        raise SnapshotError(f"no snapshot at {path} (expected orbax/ and {PAGES})")


def _orbax(path: Path, item: str, args) -> Any:
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ck:
            return ck.restore(path / "orbax", args=ocp.args.Composite(**{item: args}))[item]
    except Exception as e:
        raise SnapshotError(f"{path} is incomplete or corrupt: cannot read its {item} "
                            f"({type(e).__name__}: {e})") from e
