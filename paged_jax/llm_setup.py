"""What LLM() does before it builds its engines: the dtype it runs, the model length, the
tokenizer, the KV pool's size in blocks, the KV cache groups and the draft model; and
generate's arguments as lists (paged_jax/llm.py)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm
from tqdm.std import tqdm as std_tqdm

from paged_jax.cache.groups import KVGroups, plan_groups
from paged_jax.cache.kv_cache import kv_cache_bytes
from paged_jax.engine.speculative import SpeculativeConfig
from paged_jax.models import Tokenizer, load_model, parallel
from paged_jax.models.tokenizer import tokenizer_from_folder
from paged_jax.sampling_params import SamplingParams

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: str) -> str:
    """The dtype a checkpoint is loaded in: "auto" is bfloat16 on accelerators and float32
    on CPU, where `LLM` then runs the fastest of float32, bfloat16 and a 4-bit checkpoint's
    own codes that keeps the checkpoint's quality (paged_jax/precision.py)."""
    if dtype == "auto":
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return dtype


def positive(**values) -> None:
    """Each value a positive integer, or a ValueError naming it."""
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def model_len(asked: int | None, config) -> int:
    """max_model_len: as asked (within the model's positions), else up to 2048."""
    got = asked or min(config.max_position_embeddings, 2048)
    if got > config.max_position_embeddings:
        raise ValueError(f"max_model_len={got} exceeds the model's "
                         f"max_position_embeddings={config.max_position_embeddings}")
    return got


def _choose_dtype(asked: str, dtype: str, model: str, model_parts, quantization, config,
                  params, tok, matmul_backend: str | None = None,
                  kv_cache_dtype: str = "auto") -> tuple[dict, dict]:
    """What runs and why (LLM.dtype_choice: dtype, quantization and
    kv_cache_dtype), and the params in it: the precision check for "auto" on CPU when
    LLM loads the checkpoint itself (paged_jax/precision.py), else the dtype as resolved and
    the quantization and pages as asked; a kv_cache_dtype set wins over the check's."""
    if asked != "auto":
        return dict(dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                    reason="asked for"), params
    if model_parts is not None or quantization or jax.default_backend() != "cpu":
        return dict(dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                    reason="the platform's default" + (
                        " (weights given or quantized: no precision check)" if model_parts or
                        quantization else "")), params
    from paged_jax import precision
    from paged_jax.models.loader import model_path

    try:
        path = model_path(model)
    except (ValueError, FileNotFoundError, OSError):
        path = None
    choice = precision.choose(config, params, tok, precision.checkpoint_key(path, model),
                              quantize=matmul_backend != "xla")
    if choice["dtype"] != dtype:
        params = jax.tree.map(lambda x: x.astype(DTYPES[choice["dtype"]]), params)
    if kv_cache_dtype != "auto":
        choice = {**choice, "kv_cache_dtype": kv_cache_dtype}
    return choice, params


def what_runs(choice: dict) -> tuple:
    """A dtype_choice's (dtype as a jnp dtype, quantization, kv_cache_dtype)."""
    return DTYPES[choice["dtype"]], choice["quantization"], choice["kv_cache_dtype"]


def own_tokenizer(path: str, config) -> Tokenizer:
    """LLM(tokenizer=...): a Hugging Face folder's tokenizer, checked against the model."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"tokenizer={path!r}: expected a local Hugging Face folder with a "
                         "tokenizer.json (paged-jax downloads nothing)")
    tok = tokenizer_from_folder(folder, config.eos_token_ids)
    if tok.backend.get_vocab_size() > config.vocab_size:
        raise ValueError(f"tokenizer={path!r} has {tok.backend.get_vocab_size()} tokens, more "
                         f"than the model's vocab_size {config.vocab_size}")
    return tok


def memory_for_kv(utilization: float, params) -> int:
    """LLM(gpu_memory_utilization=...): bytes left for the KV pool once weights are placed."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError("gpu_memory_utilization needs a device that reports its memory "
                         f"({jax.devices()[0].platform} does not); pass kv_cache_memory=BYTES")
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    room = int(utilization * stats["bytes_limit"]) - weights
    if room <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} leaves no room for the KV "
                         f"cache beside {weights / 2**30:.1f} GiB of weights")
    return room


def as_requests(
    prompts: str | dict | Seq, sampling_params: SamplingParams | Seq | None
) -> tuple[list, list[SamplingParams]]:
    """generate's arguments as two equal lists: prompts, and one SamplingParams each."""
    prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params or SamplingParams()] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError(f"got {len(sampling_params)} sampling_params for "
                         f"{len(prompts)} prompts")
    return prompts, list(sampling_params)


def per_prompt(value, n: int) -> list:
    """generate's `lora_request`: one for every prompt, or a list of one per prompt."""
    if value is None or not isinstance(value, list | tuple):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"got {len(value)} lora_requests for {n} prompts")
    return list(value)


def _bar_off(use_tqdm: bool) -> bool | None:
    """tqdm's `disable`: off when not asked; in a terminal, off when stderr is not a TTY
    (None: logs and CI output get no carriage-return spam); on in notebooks (widgets)."""
    if not use_tqdm:
        return True
    return None if tqdm is std_tqdm else False


def kv_groups_for(config, hybrid: bool | None, prefix_caching: bool,
                  speculative: SpeculativeConfig | None) -> KVGroups | None:
    """The engine's KV cache groups (cache/groups.py): sliding-window layers in groups of
    their own when the model has them and `hybrid` is True or None (auto); else None: one
    group. Prefix caching works on groups (cache/prefix_cache.py); a draft model's pages
    follow a full-attention group (engine/draft.py), so auto gives one group to a draft on
    a model whose every layer slides."""
    groups = plan_groups(tuple(config.window(i) for i in range(config.num_layers)))
    draft = speculative is not None and speculative.model is not None
    if hybrid is False or not groups.hybrid or (hybrid is None and draft
                                                and groups.full_group is None):
        return None
    return groups


def block_bytes(config, draft: tuple | None, tp: int, block_size: int, kv_dtype,
                groups: KVGroups | None = None) -> int:
    """One block's bytes on one device: the model's K/V pages (one per buffer: a layer, or
    a layer of each group), and a draft model's beside them (engine/draft.py)."""
    heads = parallel.layout(config, tp).num_kv_heads
    layers = groups.num_buffers if groups else config.num_layers
    size = kv_cache_bytes(layers, heads, block_size, config.head_dim, kv_dtype)
    if draft is not None:
        d = draft[0]
        size += kv_cache_bytes(d.num_layers, d.num_kv_heads, block_size, d.head_dim, kv_dtype)
    return size


def load_draft(spec: SpeculativeConfig | None, parts, tok, dtype) -> tuple | None:
    """The draft model's (config, params) when speculative decoding asks for one (loaded
    unless `parts` are given); its tokenizer must encode as the model's does."""
    if spec is None or not spec.draft_model:
        return None
    config, params, dtok = parts or load_model(spec.model, dtype)
    probe = "def f(x):\n    return x * 2  # Hello, world! 123 \u00e9\u4e2d"
    if tok is not None and dtok is not None and tok.encode(probe) != dtok.encode(probe):
        raise ValueError(f"draft model {spec.model!r} tokenizes differently from the model: "
                         "its drafts would not be the same tokens")
    return config, params


def load_parts(model, parts, tokenizer, dtype: str) -> tuple[tuple, tuple | None, object]:
    """LLM's model: ((config, params, tokenizer), the parts given (`parts`, or a Flax
    module's), the module's forward or None). A checkpoint is loaded in `dtype` (a DTYPES
    name) unless `parts` are given; `tokenizer` (a folder) replaces its own."""
    dtype = DTYPES[dtype]
    if (own := own_model(model, tokenizer, dtype)) is not None:
        return own[0], own[0], own[1]
    config, params, tok = parts or load_model(model, dtype)
    if tokenizer is not None:
        tok = own_tokenizer(tokenizer, config)
    return (config, params, tok), parts, None


def own_model(model, tokenizer, dtype) -> tuple[tuple, object] | None:
    """LLM(model=<a Flax NNX module>): ((config, params, tokenizer), its forward) to run it
    (paged_jax/nn: the module's params as given, cast to `dtype`); None when `model` names a
    checkpoint. flax is imported only here, for a module.

    Raises:
      ValueError: the module misses the interface (paged_jax/nn/interface.py), or no
        tokenizer is given and it has none of its own.
    """
    if model is None or isinstance(model, str | Path):
        return None
    from paged_jax.nn.engine_forward import cast_params, split_model

    config, params, forward = split_model(model)
    tok = module_tokenizer(tokenizer, getattr(model, "tokenizer", None), config)
    return (config, cast_params(params, dtype), tok), forward


def module_tokenizer(asked, own, config) -> Tokenizer:
    """A user module's tokenizer: `asked` (a Tokenizer, a Hugging Face folder, a .gguf file
    or a shipped model's short name, whose tokenizer is read), else the module's own."""
    if asked is None and own is None:
        raise ValueError("LLM(model=<module>) needs a tokenizer: pass tokenizer= (a "
                         "Tokenizer, a Hugging Face folder, a .gguf file or a short name "
                         "such as 'smollm2') or give the module a `tokenizer` attribute")
    asked = own if asked is None else asked
    if isinstance(asked, Tokenizer):
        return asked
    if Path(asked).expanduser().is_dir():
        return own_tokenizer(asked, config)
    return load_model(asked)[2]  # a checkpoint's own (its params come from the params cache)
