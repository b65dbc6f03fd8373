"""`dtype="auto"` on CPU: the fastest precision whose quality holds, per checkpoint and machine.

    bfloat16  where the C++ matmul kernel holds AVX-512 BF16 dot products (half float32's
              weight bytes, twice its multiply rate; CPUs with AMX tiles have them too, and
              the kernel then runs the tiles: kernels/cpu_matmul_bf16.h) and the
              checkpoint's perplexity on PASSAGE stays within QUALITY (0.5%) of float32's
    float32   elsewhere

The check runs the model's forward over PASSAGE on both precisions as the engine would run
them (the packed C++ matmuls, bfloat16 pages for bfloat16), once per checkpoint and machine:
its result is kept in the cache folder (`precision.json`, paged_jax/compile_cache.py) and
logged once; `LLM.dtype_choice` says what was chosen and why. An explicit dtype always wins.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import compile_cache

QUALITY = 0.005  # the most a faster precision may raise the passage's perplexity
MAX_TOKENS = 256  # the passage's tokens scored (bounded: the check runs at first load)
LOG = logging.getLogger("paged_jax")

PASSAGE = (
    "The harbour town woke slowly in winter. Before the sun rose over the grey water, the "
    "bakers had already lit their ovens, and the smell of warm bread drifted along the narrow "
    "streets toward the quay. Fishing boats came back one by one, their decks crowded with "
    "nets, crates and tired men who talked little and laughed often. On the hill above the "
    "market stood an old library, built of pale stone two centuries ago, where a single "
    "librarian kept the lamps burning and the catalogue in order.\n\n"
    "Most mornings the first visitor was a retired schoolteacher who read newspapers from "
    "distant cities and wrote long letters to friends she had not seen in years. She liked "
    "the quiet of the reading room, the creak of the wooden floor and the way the light fell "
    "across the tables when the clouds broke. The librarian knew which chair she preferred "
    "and which papers she would ask for, and had them ready before she arrived.\n\n"
    "In the afternoon the children came from school. They wanted stories about ships, storms "
    "and islands that did not appear on any map. The librarian read aloud to them in a low "
    "voice, pausing at the best moments so that they leaned closer and begged her to go on. "
    "Some of them later borrowed the same books again and again, until the pages were soft "
    "and the spines had to be mended with tape and thread.\n\n"
    "When spring returned, the town changed its rhythm. Tourists arrived on the morning "
    "train, the cafes set out chairs along the water, and the market filled with flowers, "
    "cheese and early vegetables from the farms inland. The library grew busier too: "
    "students prepared for their examinations, travellers looked for maps of the coast, and "
    "a few writers rented the small room upstairs to finish the books they had promised to "
    "their publishers long ago. Through all of it the librarian kept the same calm routine, "
    "opening the doors at nine, closing them at six, and writing in a thick notebook every "
    "evening what the town had read that day."
)
"""A fixed English passage (written for this project) whose perplexity the precision check
and the quantization experiments measure: about 400 tokens."""


def bf16_dot_here() -> bool:
    """Whether this machine's build of the C++ matmul kernel holds bfloat16 dot products."""
    from kernels import cpu_matmul

    if jax.default_backend() != "cpu":
        return False
    paths = cpu_matmul.isa_paths(str(compile_cache.kernel_folder()))
    return bool(paths & cpu_matmul.PATH_BF16_DOT)


def passage_perplexity(config, params, tokenizer, weights: str) -> float:
    """exp(mean -log p) of PASSAGE's next tokens (its first MAX_TOKENS), teacher-forced in
    one prefill, with the projections packed as `weights` for the C++ kernel and the pages
    in that precision."""
    from paged_jax.cache.kv_cache import init_kv_cache
    from paged_jax.models.llama import forward, pack_params, prepare_params

    ids = np.asarray(tokenizer.encode(PASSAGE)[:MAX_TOKENS], np.int32)
    t, block = len(ids), 16
    pages = -(-t // block)
    dtype = jnp.bfloat16 if weights == "bfloat16" else jnp.float32
    laid = pack_params(prepare_params(jax.tree.map(lambda x: x.astype(dtype), params)),
                       weights)
    cache = init_kv_cache(config.num_layers, config.num_kv_heads, pages + 1, block,
                          config.head_dim, dtype)
    pos = jnp.arange(t, dtype=jnp.int32)
    logits, _ = jax.jit(lambda p, c: forward(
        p, c, jnp.asarray(ids), pos, pos + block, jnp.arange(1, pages + 1)[None],
        jnp.asarray([t], jnp.int32), jnp.asarray([0, t], jnp.int32), config=config, max_q=t,
        all_logits=True))(laid, cache)
    logp = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(ids[1:, None]), axis=-1)
    return float(math.exp(float(jnp.mean(nll))))


def choose(config, params, tokenizer, key: str) -> dict:
    """The precision `dtype="auto"` runs on this CPU (module docstring): dict(dtype, reason,
    and the perplexities measured), from the cache when this checkpoint and machine were
    checked before. `key` names the checkpoint (its file and size)."""
    if not bf16_dot_here():
        return dict(dtype="float32", reason="no bfloat16 dot products in this CPU's kernel")
    path = cache_file()
    seen = json.loads(path.read_text()) if path.exists() else {}
    k = hashlib.sha256(f"{key}|{_machine()}|{QUALITY}|{MAX_TOKENS}".encode()).hexdigest()[:20]
    if k not in seen:
        f32 = passage_perplexity(config, params, tokenizer, "float32")
        bf16 = passage_perplexity(config, params, tokenizer, "bfloat16")
        ok = bf16 <= f32 * (1 + QUALITY)
        seen[k] = dict(dtype="bfloat16" if ok else "float32", perplexity_float32=f32,
                       perplexity_bfloat16=bf16, reason=(
                           f"bfloat16's passage perplexity {bf16:.4f} against float32's "
                           f"{f32:.4f}: {'within' if ok else 'past'} {QUALITY:.1%}"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(seen, indent=1))
        LOG.warning("dtype='auto' on this CPU: %s (%s)", seen[k]["dtype"], seen[k]["reason"])
    return seen[k]


def cache_file() -> Path:
    """Where the checks' results are kept: beside the compiled programs."""
    return compile_cache.cache_root() / "precision.json"


def checkpoint_key(path: str | Path | None, model: str) -> str:
    """A checkpoint's identity for the cache: its file's path, size and time, else its name."""
    p = Path(path) if path else None
    if p and p.exists():
        st = p.stat()
        return f"{p.resolve()}|{st.st_size}|{int(st.st_mtime)}"
    return model


def _machine() -> str:
    from kernels import cpp_build

    return hashlib.sha256(cpp_build._cpu_id().encode()).hexdigest()[:12]
