"""A Flax NNX module as the engine's forward: `split_model(module) -> (config, params,
forward)`.

    nnx.split(module)  -> graphdef (the module's structure and static attributes: hashable,
                          part of the step programs' static config, StepConfig.forward)
                        + state   (every array: the params pytree the runner holds and passes
                                   into each jitted call as an argument)
    forward(params, cache, token_ids, ...)   models.llama.forward's signature and results;
                          inside the traced call `nnx.merge(graphdef, params)` rebuilds the
                          module over the traced arrays and calls it on a `RaggedStep`

Because the params stay an argument (not closed over as constants), one compiled program
serves every call, and two modules of the same structure share their programs. The engine
imports none of this: it calls whatever forward its StepConfig holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from paged_jax.cache.kv_cache import KVCache
from paged_jax.models.config import ModelConfig
from paged_jax.nn.interface import RaggedStep, check_model
from paged_jax.types import Array, Int


class ModuleForward:
    """A module's graphdef as a forward function (module docstring); equal and hashed by
    the graphdef, so a StepConfig holding it is a stable static argument. Its params are
    the module's state (an nnx.State: a Mapping pytree)."""

    def __init__(self, graphdef: nnx.GraphDef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)  # once: programs key every call on the StepConfig

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModuleForward) and other.graphdef == self.graphdef

    def __call__(
        self, params: Mapping, cache: KVCache, token_ids: Int[Array, "T"],
        positions: Int[Array, "T"], cache_positions: Int[Array, "T"] | Int[Array, "G T"],
        block_tables: Int[Array, "S P"] | Int[Array, "G S P"], seq_lens: Int[Array, "S"],
        query_start: Int[Array, "S+1"], *, config: ModelConfig, max_q: int,
        backend: str = "reference", all_logits: bool = False, max_q_rows: int | None = None,
        decode_pages: int | None = None, with_hidden: bool = False, **unsupported: Any,
    ) -> tuple[Any, KVCache]:
        """`models.llama.forward`'s contract (its docstring) over the module: (logits fp32,
        cache'), or ((logits, each sequence's last hidden state fp32 [S, E]), cache')
        with_hidden. `config` is the module's own (the engine's copy of it)."""
        _refuse(unsupported)
        if block_tables.ndim == 2:  # one KV cache group
            block_tables, cache_positions = block_tables[None], cache_positions[None]
        step = RaggedStep(token_ids, positions, cache_positions, block_tables, seq_lens,
                          query_start, max_q, backend, max_q_rows, decode_pages, all_logits)
        logits, hidden, cache = nnx.merge(self.graphdef, params)(cache, step)
        logits = logits.astype(jnp.float32)
        if not with_hidden:
            return logits, cache
        last = hidden[step.last_tokens()] if all_logits else hidden
        return (logits, last.astype(jnp.float32)), cache


def _refuse(unsupported: dict) -> None:
    """The forward's features a user module does not have (the runner refuses the engine
    settings that would ask for them; this catches a direct caller)."""
    asked = [k for k, v in unsupported.items() if v not in (None, False)]
    if asked:
        raise ValueError(f"a Flax module's forward does not support {sorted(asked)} "
                         "(tensor parallelism, MoE router load, LoRA)")


def split_model(model: nnx.Module) -> tuple[ModelConfig, Mapping, ModuleForward]:
    """(config, params, forward) of a module implementing paged_jax/nn/interface.py: what
    `Engine(config, params, tokenizer, ec, forward=forward)` runs.

    Raises:
      ValueError: it is not an nnx.Module, misses the interface, or has a static attribute
        that cannot be hashed (a list: use a tuple), which a compiled program cannot key on.
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(f"expected a flax.nnx.Module, got {type(model).__name__}")
    config = check_model(model)
    graphdef, params = nnx.split(model)
    try:
        forward = ModuleForward(graphdef)
    except TypeError as err:
        raise ValueError(f"{type(model).__name__} has a static attribute that cannot be "
                         f"hashed ({err}); hold tuples, not lists or dicts") from err
    return config, params, forward


def cast_params(params: Mapping, dtype: DTypeLike) -> Mapping:
    """Floating-point arrays of `params` in `dtype` (the rest as they are)."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return x.astype(dtype) if floating and x.dtype != dtype else x
    return jax.tree.map(cast, params)
