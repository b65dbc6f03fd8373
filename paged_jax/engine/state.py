"""The device state of an engine and the static knobs its programs are compiled for."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import Mesh

from paged_jax.cache.kv_cache import KVCache
from paged_jax.cache.page_table import PageTable
from paged_jax.cache.pool import BlockPool
from paged_jax.models import ModelConfig
from paged_jax.sample import sampler as smp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngineState:
    """Everything the device holds between steps (donated to every step). `draft`: the
    draft model's K/V pages under the same block ids and page tables (speculative decoding
    with a draft model, engine/draft.py); None without one."""

    pool: BlockPool
    table: PageTable
    cache: KVCache
    sampling: smp.SamplingState
    draft: KVCache | None = None


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static knobs fixed for an engine's lifetime (hashable: part of the jit cache key)."""

    model: ModelConfig
    backend: str = "reference"
    mesh: Mesh | None = None  # tensor parallelism: the "model" mesh (paged_jax/models/parallel.py)
    prefix_caching: bool = False  # report newly full blocks and refcounts (StepOut)
    draft_model: ModelConfig | None = None  # speculative decoding's draft (engine/draft.py)
    draft_stop: float = 0.0  # a row stops drafting below this probability (draft.propose)
    # the target model's forward (models.llama.forward's signature; None: that one): a
    # user's own Flax module (paged_jax/nn/engine_forward.py), hashed by its structure
    forward: Callable | None = None


class Sleeping(RuntimeError):
    """A request or call reached a sleeping engine (engine/sleep.py; servers answer 503)."""

    @classmethod
    def check(cls, asleep) -> None:
        """Raises unless `asleep` (Engine.asleep) is None."""
        if asleep is not None:
            raise cls(f"the engine is asleep (level {asleep.level}): call wake_up() first")
