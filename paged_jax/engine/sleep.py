"""Sleep mode (vLLM's names and levels): an idle engine gives its device memory back between
uses (an RL trainer's rollouts, a server that sleeps at night) and wakes without compiling.

    sleep(engine, 1)   weights copied to host memory, then dropped from the device; the KV
                       pages, page tables and prefix cache discarded
    sleep(engine, 2)   weights and KV discarded (wake_up needs the weights again: LLM reloads
                       them from the model's files); a draft model's weights go to host
                       memory as at level 1 (they are not the ones a trainer replaces)
    wake_up(engine)    the weights back on their devices with their old shardings, a fresh
                       pool and zeroed pages; every array keeps its shape, dtype and
                       placement, so every compiled program still applies (checked: the
                       runner's layout must come back equal, else the wake is refused)

The engine must be idle: sleeping drops the KV cache, so a running request would lose its
context (finish or abort requests first, or save them with engine/snapshot.py). Memory is
freed by dropping the engine's references: weights another engine shares (runner.py's
`shared_weights`) stay while that engine holds them, and `sleep` reports the bytes it freed.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.cache import page_table as pt
from paged_jax.cache import pool as pool_lib
from paged_jax.engine.kv_manager import KVManager
from paged_jax.engine.programs import layout_of
from paged_jax.engine.state import EngineState, Sleeping  # noqa: F401 (re-exported)
from paged_jax.models import parallel
from paged_jax.sample import sampler as smp

if TYPE_CHECKING:
    from paged_jax.engine.engine import Engine


@dataclasses.dataclass
class Asleep:
    """What a sleeping engine keeps to wake: host copies of its weights' leaves (params None
    where a level-2 sleep discarded them), their placements, and the device state's parts as
    (tree structure, leaves of jax.ShapeDtypeStruct) (trees are kept flat: the typed state
    dataclasses take arrays only)."""

    level: int
    params: list | None
    draft: list | None
    defs: tuple  # the tree structures of the params and the draft's params
    shardings: tuple  # of their leaves
    state: dict[str, tuple]  # EngineState field -> (structure, abstract leaves)
    freed: int = 0  # device bytes sleeping freed


def live_bytes() -> int:
    """Bytes of every live jax array (device memory in use, on any backend)."""
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def sleep(engine: Engine, level: int = 1) -> int:
    """Puts an idle engine to sleep at `level` (1 or 2); returns the device bytes freed."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    if engine.asleep is not None:  # asleep already: level 2 drops the host copies too
        if level == 2 and engine.asleep.level == 1:
            engine.asleep.level, engine.asleep.params = 2, None
        return 0
    if engine.has_unfinished() or engine.requests:
        raise RuntimeError(f"sleep needs an idle engine: {len(engine.requests)} requests are "
                           "unfinished (sleeping discards the KV cache they run on)")
    engine.settle()
    gc.collect()  # unreachable arrays freed now, not counted as what sleeping freed
    rn, before = engine.runner, live_bytes()
    (pleaves, pdef), (dleaves, ddef) = (jax.tree.flatten(t) for t in (rn.params,
                                                                      rn.draft_params))
    state = {f.name: jax.tree.flatten(getattr(rn.state, f.name))
             for f in dataclasses.fields(rn.state)}
    asleep = Asleep(level, None if level == 2 else _to_host(pleaves), _to_host(dleaves),
                    (pdef, ddef), tuple([x.sharding for x in leaves]
                                        for leaves in (pleaves, dleaves)),
                    {k: (d, [_abstract(x) for x in leaves]) for k, (leaves, d) in state.items()})
    rn.params = rn.draft_params = rn.state = None
    rn._held = []  # the laid-out weights' holder (runner.py): dropped with them
    del pleaves, dleaves, state
    kv = engine.kv  # a fresh manager: no slot, block or cached prefix survives the KV cache
    engine.kv = engine.scheduler.kv = KVManager(
        kv.config, kv.block_bytes, rn, prefix_caching=kv.prefix is not None, swap=kv.swap,
        swap_space=kv.swap_space)
    asleep.freed = before - live_bytes()
    engine.asleep = asleep
    return asleep.freed


def wake_up(engine: Engine, params: Any = None) -> None:
    """Wakes a sleeping engine (a no-op on an awake one). After level 2, `params` are the
    model's weights in checkpoint form (as loaded), laid out again here; after level 1 the
    host copies are used and `params` must be None."""
    asleep, rn = engine.asleep, engine.runner
    if asleep is None:
        return
    if (asleep.level == 2) != (params is not None):
        raise ValueError("wake_up after sleep level 2 needs the weights (params=...), after "
                         "level 1 it takes none" if params is None else
                         "wake_up(params=...) applies after sleep level 2 only")
    leaves = asleep.params if params is None else _lay_out(rn, params, asleep.defs[0])
    pleaves, dleaves = jax.device_put((leaves, asleep.draft), asleep.shardings)
    weights = tuple(jax.tree.unflatten(d, x) for d, x in zip(asleep.defs, (pleaves, dleaves),
                                                            strict=True))
    state = _fresh_state(rn, asleep.state)
    if layout_of((weights[0], state, weights[1])) != rn.layout:
        raise ValueError("the weights given differ in shape or dtype from the engine's: its "
                         "compiled programs would not apply (the engine stays asleep)")
    rn.params, rn.draft_params = weights
    rn.state, engine.asleep = state, None


def _to_host(leaves: list) -> list:
    """Host copies (np.array copies: on a CPU backend np.asarray would alias the device
    buffer and keep it alive)."""
    return [np.array(x) for x in leaves]


def _abstract(x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _lay_out(rn, params: Any, want) -> list:
    """Checkpoint-form weights in the runner's layout (level 2's wake), as built at start:
    their leaves, refused (ValueError) unless they make the tree the engine had."""
    if rn.mesh is not None:
        raise NotImplementedError("sleep level 2 under tensor parallelism: use level 1")
    device = parallel.devices(1, rn.config.first_device)[0]
    laid = (jax.device_put(params, device) if rn.cfg.forward is not None  # a user's module
            else rn._lay_out(params, device))
    if rn.config.lora is not None:
        laid = {**laid, "lora": rn.adapters.device_tree()}
    leaves, got = jax.tree.flatten(laid)
    if got != want:
        raise ValueError("the weights given are not the engine's model (other parameter "
                         "names or layers): the engine stays asleep")
    return leaves


def _fresh_state(rn, parts: dict[str, tuple]) -> EngineState:
    """A new engine's device state, each leaf placed as before sleeping: every block free,
    no sequence, zeroed K/V pages."""
    cc = rn.config.cache
    fresh = {"pool": pool_lib.init_pool(cc.num_blocks), "table": pt.init_page_table(cc),
             "sampling": smp.init_sampling_state(cc.max_seqs, rn.model.vocab_size)}
    out = {}
    for name, (tree, like) in parts.items():
        if name in fresh:
            leaves = jax.device_put(jax.tree.leaves(fresh[name]), [a.sharding for a in like])
        else:  # the K/V pages (and a draft model's): zeros, as at start
            leaves = [jnp.zeros(a.shape, a.dtype, device=a.sharding) for a in like]
        out[name] = jax.tree.unflatten(tree, leaves)
    return EngineState(**out)
