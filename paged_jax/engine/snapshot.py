"""Engine snapshots: everything an engine holds, saved whole, so that an engine of the same
model and layout in another process continues every request with exactly the tokens it would
have produced without stopping.

    save(engine, path)     drains the step in flight, then writes (engine/snapshot_files.py):
        the device state (EngineState: pool, page tables and sampling state through orbax,
        the K/V pages through safetensors); the host mirror (requests and their sequences,
        queues, the KV manager's facts and queued ops, the prefix cache, swapped-out
        blocks, sampler seeds, stop-string tails) pickled into one uint8 array beside the
        small arrays; and JSON metadata of what the snapshot fits (model config, weights
        digest, engine layout, every state leaf's dtype and shape), read first by `restore`.
    restore(engine, path)  refuses a snapshot of another model, dtype or layout (naming the
        first difference), reads everything into new objects, and only then replaces the
        engine's: a partial or corrupt snapshot raises SnapshotError and leaves it as it was.

Why pickle for the host side: the mirror is a graph of plain Python objects (a request's
sequences point at it, the KV manager's owners at the sequences); one pickle keeps those
identities, where a JSON schema of every field would be a second writer of each fact.
Objects the new engine builds itself (tokenizer, runner, KV manager, scheduler, policy,
structured-output compiler) are written as references and bound to the new engine's on load.
LoRA slots are not saved: restored requests name their adapters, read again on demand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import pickle
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from paged_jax.engine import snapshot_files as files
from paged_jax.engine.snapshot_files import SnapshotError
from paged_jax.engine.state import EngineState

if TYPE_CHECKING:
    from paged_jax.engine.engine import Engine

FORMAT = 1
_SCHEDULER_OWN = ("config", "kv", "tokenizer", "policy")  # the new engine's, never saved
_KV_OWN = ("config", "device", "block_bytes", "swap", "swap_space", "_windows")


@dataclasses.dataclass(frozen=True)
class SnapshotStats:
    seconds: float
    bytes: int
    requests: int


def save(engine: Engine, path: str | Path, extra: dict | None = None) -> SnapshotStats:
    """Writes `engine` whole to the new folder `path` (refused if it exists: a snapshot is
    never overwritten in place); `extra` (picklable) comes back from `restore`."""
    path = Path(path).absolute()
    if path.exists():
        raise FileExistsError(f"{path} exists: a snapshot is never written over (pick a new "
                              "path, or delete the old one once the new one is saved)")
    _check_savable(engine)
    t0 = time.perf_counter()
    engine.drain()  # no call in flight: the host mirror is exact, the device state final
    host = np.frombuffer(_pickle_host(engine, extra or {}), np.uint8)
    small, pages = _parts(engine.runner.state)
    meta = {**fingerprint(engine), "requests": len(engine.requests), "saved": time.time(),
            "host_bytes": int(host.size)}
    size = files.write(path, meta, {**small, "host": host}, pages)
    return SnapshotStats(time.perf_counter() - t0, size, len(engine.requests))


def restore(engine: Engine, path: str | Path) -> dict:
    """Replaces an idle engine's requests and device state by the snapshot's; returns the
    `extra` saved with it. Raises SnapshotError (the engine unchanged) when the snapshot is
    of another model / dtype / layout, or incomplete or corrupt."""
    path = Path(path).absolute()
    if engine.has_unfinished() or engine.requests:
        raise RuntimeError(f"restore needs an idle engine: it holds {len(engine.requests)} "
                           "unfinished requests (finish or abort them first)")
    meta = files.read_meta(path)
    if meta.get("format") != FORMAT:
        raise SnapshotError(f"{path}: snapshot format {meta.get('format')!r}, this version "
                            f"reads {FORMAT}")
    mismatch(meta, fingerprint(engine), path)
    state = engine.runner.state
    small, pages = _parts(state)
    like = {k: ocp.utils.to_shape_dtype_struct(x) for k, x in small.items()}
    got = files.read_small(path, {**like, "host": jax.ShapeDtypeStruct(
        (meta["host_bytes"],), np.uint8)})
    host = _unpickle_host(engine, np.asarray(got.pop("host")).tobytes(), path)
    _reread_adapters(engine, host["requests"], path)
    got |= files.read_pages(path, meta, pages)
    engine.runner.state = _joined(state, got)
    _install_host(engine, host)
    return host["extra"]


def _parts(state: EngineState) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """The state's leaves by name: the small arrays (pool, page tables, sampling state) and
    the K/V pages (the model's and a draft model's)."""
    small = (state.pool, state.table, state.sampling)
    return ({f"s{i:04d}": x for i, x in enumerate(jax.tree.leaves(small))},
            {f"p{i:04d}": x for i, x in enumerate(jax.tree.leaves((state.cache,
                                                                    state.draft)))})


def _joined(like: EngineState, leaves: dict[str, jax.Array]) -> EngineState:
    """An EngineState of `like`'s structure from the leaves `_parts` named."""
    small = jax.tree.unflatten(jax.tree.structure((like.pool, like.table, like.sampling)),
                               [leaves[k] for k in sorted(leaves) if k[0] == "s"])
    cache, draft = jax.tree.unflatten(jax.tree.structure((like.cache, like.draft)),
                                      [leaves[k] for k in sorted(leaves) if k[0] == "p"])
    return EngineState(*small[:2], cache, small[2], draft)


def _reread_adapters(engine: Engine, requests: dict, path: Path) -> None:
    """Registers the LoRA adapters of restored requests, read as add_request reads them
    (the restoring engine's slots start empty and fill on demand)."""
    for req in requests.values():
        if req.lora is not None:
            try:
                engine.runner.adapters.check(req.lora)
            except (ValueError, OSError) as e:
                raise SnapshotError(f"{path}: request {req.request_id!r} runs adapter "
                                    f"{req.lora.lora_name!r}, which no longer reads: {e}") from e


def fingerprint(engine: Engine) -> dict:
    """What a snapshot must agree with to be restored into `engine`: the model's config, a
    digest of its weights, the engine's layout and the device state's leaves."""
    ec, rn = engine.config, engine.runner
    layout = {"block_size": ec.block_size, "num_kv_blocks": ec.num_kv_blocks,
              "max_num_seqs": ec.max_num_seqs, "max_model_len": ec.max_model_len,
              "kv_cache_dtype": ec.kv_cache_dtype, "weights": rn.weights,
              "quantization": ec.quantization, "prefix_caching": ec.enable_prefix_caching,
              "preemption_mode": ec.preemption_mode, "kv_groups": repr(ec.kv_groups),
              "speculative": repr(ec.speculative), "lora": repr(ec.lora),
              "tensor_parallel_size": ec.tensor_parallel_size}
    leaves = jax.tree_util.tree_flatten_with_path(rn.state)[0]
    state = {jax.tree_util.keystr(k): f"{x.dtype}{list(x.shape)}" for k, x in leaves}
    return {"format": FORMAT, "model": _plain(dataclasses.asdict(engine.model_config)),
            "weights": weights_digest({k: v for k, v in rn.params.items() if k != "lora"}),
            "engine": layout, "state": state}


def weights_digest(params: Any) -> str:
    """A digest of the weights' dtypes, shapes and leading bytes (two models of one config
    differ in their first values; hashing every byte of a 6 GB model would cost seconds).
    LoRA slots are left out: they follow the requests, and fill again on demand."""
    h = hashlib.sha256()
    for x in jax.tree.leaves(params):
        if isinstance(x, jax.Array | np.ndarray):
            h.update(f"{x.dtype}{x.shape}".encode())
            h.update(np.asarray(x).reshape(-1)[:256].tobytes())
    return h.hexdigest()[:16]


def mismatch(saved: dict, here: dict, path: Path) -> None:
    """Raises SnapshotError naming the first field where the snapshot and the engine differ."""
    for part in ("model", "weights", "engine", "state"):
        a, b = saved.get(part), here[part]
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            key = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            raise SnapshotError(f"{path} was saved from another {part}: {key} is "
                                f"{a.get(key)!r} there, {b.get(key)!r} here")
        raise SnapshotError(f"{path} was saved from other {part} ({a!r}, here {b!r})")


def _check_savable(engine: Engine) -> None:
    if engine.config.tensor_parallel_size > 1:
        raise NotImplementedError("save_state runs on one device per engine for now "
                                  "(tensor_parallel_size > 1 is not saved)")
    if engine.runner.params is None:
        raise RuntimeError("the engine is asleep: wake_up() before save_state")
    held = [r.request_id for r in engine.requests.values()
            if r.params.structured_outputs is not None]
    if held:  # a grammar matcher's state lives in llguidance, not in Python objects
        raise NotImplementedError(f"requests with structured outputs cannot be saved yet: "
                                  f"{held[:5]} (let them finish first)")


def _externals(engine: Engine) -> dict[str, Any]:
    """The objects a snapshot refers to by name: the restoring engine's own."""
    return {"tokenizer": engine.tokenizer, "runner": engine.runner, "kv": engine.kv,
            "scheduler": engine.scheduler, "policy": engine.scheduler.policy,
            "constraints": engine.constraints}


def _pickle_host(engine: Engine, extra: dict) -> bytes:
    sched, kv = engine.scheduler, engine.kv
    counters = {k: next(v) for k, v in vars(sched).items() if isinstance(v, itertools.count)}
    for k, v in counters.items():  # reading a count moves it: put it back where it was
        setattr(sched, k, itertools.count(v))
    host = {"requests": engine.requests, "counters": counters, "extra": extra,
            "scheduler": {k: v for k, v in vars(sched).items()
                          if k not in _SCHEDULER_OWN and k not in counters},
            "kv": {k: v for k, v in vars(kv).items() if k not in _KV_OWN}}
    ext = {id(obj): name for name, obj in _externals(engine).items()}
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = lambda obj: ext.get(id(obj))
    pickler.dump(host)
    return buf.getvalue()


def _unpickle_host(engine: Engine, blob: bytes, path: Path) -> dict:
    unpickler = pickle.Unpickler(io.BytesIO(blob))
    unpickler.persistent_load = _externals(engine).__getitem__
    try:
        return unpickler.load()
    except Exception as e:  # a truncated or altered blob: nothing was installed yet
        raise SnapshotError(f"{path}: the host state does not read back ({e})") from e


def _install_host(engine: Engine, host: dict) -> None:
    engine.requests = host["requests"]
    for k, v in host["scheduler"].items():
        setattr(engine.scheduler, k, v)
    for k, v in host["counters"].items():
        setattr(engine.scheduler, k, itertools.count(v))
    for k, v in host["kv"].items():
        setattr(engine.kv, k, v)


def _plain(x: Any) -> Any:
    """A JSON-ready copy (tuples as lists, other values as their repr)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return repr(x)
