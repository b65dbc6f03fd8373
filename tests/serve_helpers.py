"""Tiny-model servers for the tests (serve/background.Server: in this process, a free port)."""

from __future__ import annotations

from paged_jax.llm import LLM
from paged_jax.serve.api import build_app
from paged_jax.serve.background import Server
from tests.engine_helpers import model

MODEL = "tiny"
# No decode_window: servers run LLM's default, async scheduling (every step delivered).
ENGINE = dict(block_size=8, num_kv_blocks=160, max_num_seqs=8, max_num_batched_tokens=64,
              max_model_len=256, static_shapes=True)


def tiny_llm(**overrides) -> LLM:
    return LLM(model_parts=model(), **{**ENGINE, **overrides})


def serve(max_pending: int = 256, **overrides) -> Server:
    return Server(build_app(tiny_llm(**overrides), MODEL, max_pending))


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample of Prometheus text (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            rest = line[len(name):]
            if rest[:1] in (" ", "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0
