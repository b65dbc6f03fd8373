"""What a model provides to run in the engine, and what one engine call gives it.

A model is a Flax NNX module with

    config      a `ModelConfig`: the engine reads the KV layout from it (num_layers,
                num_kv_heads, head_dim, each layer's window), the vocabulary, hidden_size (the
                width of the hidden states it returns), eos_token_ids and
                max_position_embeddings; the rest of its fields are the model's own business
    __call__(cache, step) -> (logits, hidden, cache)
                one forward over a ragged step's tokens (`RaggedStep`): each layer writes its
                K/V and attends through `PagedAttention` (paged_jax/nn/attention.py); logits
                and hidden are the rows `step.rows` picks (each sequence's last token, or
                every token when the engine asks), hidden the final-normed vectors the
                logits come from
    tokenizer   optional: the `Tokenizer` LLM uses when none is passed

and, by convention, a classmethod `from_params(config, params)` building it from
`load_model`'s checkpoint-form params (models/llama.py's docstring lists their names), which is
how our port (paged_jax/nn/llama.py) loads real weights. The engine never sees the module:
`engine_forward.split_model` turns it into params (a pytree) and a pure forward function.

Axis letters: paged_jax/types.py (G: KV cache groups, cache/groups.py).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from paged_jax.cache.kv_cache import KVCache
from paged_jax.models.config import ModelConfig
from paged_jax.types import Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedStep:
    """One engine call's tokens and their paging (models/attention.py's ragged batch).

    Attributes:
      token_ids, positions: [T] per token; padding tokens have cache position < 0.
      cache_positions: [G, T] where each token's K/V goes, per KV cache group.
      block_tables: [G, S, P] each sequence's pages, per group.
      seq_lens: [S] context length per sequence, this step's tokens included (0: padding).
      query_start: [S + 1] where each sequence's tokens start in the flat run.
      max_q, backend, max_q_rows, decode_pages: `paged_attention`'s static arguments.
      all_logits: the engine wants every token's logits (prompt logprobs, speculation), not
        only each sequence's last.
    """

    token_ids: Int[Array, "T"]
    positions: Int[Array, "T"]
    cache_positions: Int[Array, "G T"]
    block_tables: Int[Array, "G S P"]
    seq_lens: Int[Array, "S"]
    query_start: Int[Array, "S+1"]
    max_q: int = dataclasses.field(default=1, metadata=dict(static=True))
    backend: str = dataclasses.field(default="reference", metadata=dict(static=True))
    max_q_rows: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    decode_pages: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    all_logits: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def paging(self, group: int) -> tuple[Int[Array, "T"], Int[Array, "S P"]]:
        """(cache positions, block tables) of KV cache group `group` (a layer's:
        `KVCache.group_of`)."""
        return self.cache_positions[group], self.block_tables[group]

    def attention_kwargs(self) -> dict:
        """The static keyword arguments `paged_attention` takes from the step."""
        return dict(max_q=self.max_q, backend=self.backend, max_q_rows=self.max_q_rows,
                    decode_pages=self.decode_pages)

    def last_tokens(self) -> Int[Array, "S"]:
        """Each sequence's last token in the flat run (0 for padding rows)."""
        return jnp.clip(self.query_start[1:] - 1, 0)

    def rows(self, x: Float[Array, "T E"]) -> Float[Array, "S E"] | Float[Array, "T E"]:
        """The rows a model computes logits for: each sequence's last token's, or every
        token's when `all_logits` (apply before the LM head: a prefill chunk's other tokens
        would cost a [T, V] product for nothing)."""
        return x if self.all_logits else x[self.last_tokens()]


@runtime_checkable
class PagedModel(Protocol):
    """The interface of a model the engine runs (module docstring)."""

    config: ModelConfig

    def __call__(self, cache: KVCache, step: RaggedStep) -> tuple[Array, Array, KVCache]:
        ...


def check_model(model: object) -> ModelConfig:
    """`model`'s config, or a ValueError saying what the interface misses."""
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise ValueError(f"{type(model).__name__} has no `config` (a paged_jax ModelConfig "
                         "giving its KV layout): see paged_jax/nn/interface.py")
    if not callable(model):
        raise ValueError(f"{type(model).__name__} is not callable as "
                         "`model(cache, step) -> (logits, hidden, cache)`")
    return config
