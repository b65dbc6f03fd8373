"""`dtype="auto"` on CPU: the fastest precision whose quality holds, per checkpoint and machine.

    int8      a checkpoint whose weights are 4-bit codes (a GGUF Q4 file, dequantized at
              load) keeps its own codes: quantization="int8" keeps every tensor on a 4-bit
              grid as it is and multiplies it in integers against x quantized per row and
              32 inputs (W4A8, as llama.cpp runs the same file), the other tensors as int8
              (kernels/cpu_matmul.py); considered when at least half the weights keep a grid
    bfloat16  where the C++ matmul kernel holds AVX-512 BF16 dot products (half float32's
              weight bytes, twice its multiply rate; CPUs with AMX tiles have them too, and
              the kernel then runs the tiles: kernels/cpu_matmul_bf16.h)
    float32   the reference the others are held to, and what runs when neither applies

Each precision's weights are tried over float32 pages and over bfloat16 pages (half the bytes a
decode step reads from its K/V; bfloat16 weights only over bfloat16 pages). Each such side runs
the model's forward over PASSAGE as the engine would run it (the packed C++ matmuls, the pages
in their dtype); those whose perplexity stays within QUALITY (0.5%) of float32's have one decode
step's matmuls (every projection and the head) and its attention (K/V writes and paged
attention over every layer's pages of MAX_TOKENS-token rows) timed at 1 and 16 rows, best of 5
(`matmul_times`, `attention_times`), and the fastest runs. The check runs once per checkpoint
and machine: its result is kept in the cache folder (`precision.json`,
paged_jax/compile_cache.py) and logged once; `LLM.dtype_choice` says what was chosen and why.
An explicit dtype or quantization always wins, unchecked (dtype="bfloat16" or "float32" runs
unquantized, over pages of that dtype), and so does an explicit kv_cache_dtype over the check's
pages.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import compile_cache

QUALITY = 0.005  # the most a faster precision may raise the passage's perplexity
MAX_TOKENS = 256  # the passage's tokens scored (bounded: the check runs at first load)
ROWS = (1, 16)  # the decode rows a precision's matmuls are timed at
METHOD = 2  # what the check measures and how: a change to it must re-check cached choices
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


def kernel_paths() -> int:
    """The ISA paths of this machine's build of the C++ matmul kernel (0 off the CPU, or
    when it does not build)."""
    from kernels import cpu_matmul

    if jax.default_backend() != "cpu":
        return 0
    return cpu_matmul.isa_paths(str(compile_cache.kernel_folder()))


def bf16_dot_here() -> bool:
    """Whether this machine's build of the C++ matmul kernel holds bfloat16 dot products."""
    from kernels import cpu_matmul

    return bool(kernel_paths() & cpu_matmul.PATH_BF16_DOT)


def laid_out(params, weights: str):
    """The runtime-form params with the projections packed as `weights` for the C++ kernel
    (float32 params in, cast to bfloat16 first for "bfloat16")."""
    from paged_jax.models.llama import pack_params, prepare_params

    dtype = jnp.bfloat16 if weights == "bfloat16" else jnp.float32
    return pack_params(prepare_params(jax.tree.map(lambda x: x.astype(dtype), params)),
                       weights)


def passage_perplexity(config, params, tokenizer, weights: str, laid=None,
                       pages: str | None = None) -> float:
    """exp(mean -log p) of PASSAGE's next tokens (its first MAX_TOKENS), teacher-forced in
    one prefill, with the projections packed as `weights` for the C++ kernel (`laid`: those
    params already packed) and the K/V pages in `pages` (default: bfloat16 for bfloat16
    weights, else float32)."""
    from paged_jax.cache.kv_cache import init_kv_cache
    from paged_jax.models.llama import forward

    ids = np.asarray(tokenizer.encode(PASSAGE)[:MAX_TOKENS], np.int32)
    t, block = len(ids), 16
    n = -(-t // block)
    pages = pages or native_pages(weights)
    laid = laid_out(params, weights) if laid is None else laid
    cache = init_kv_cache(config.num_layers, config.num_kv_heads, n + 1, block,
                          config.head_dim, jnp.dtype(pages))
    pos = jnp.arange(t, dtype=jnp.int32)
    logits, _ = jax.jit(lambda p, c: forward(
        p, c, jnp.asarray(ids), pos, pos + block, jnp.arange(1, n + 1)[None],
        jnp.asarray([t], jnp.int32), jnp.asarray([0, t], jnp.int32), config=config, max_q=t,
        all_logits=True))(laid, cache)
    logp = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(ids[1:, None]), axis=-1)
    return float(math.exp(float(jnp.mean(nll))))


def native_pages(weights: str) -> str:
    """The pages a precision runs with kv_cache_dtype="auto" (its activations' dtype)."""
    return "bfloat16" if weights == "bfloat16" else "float32"


def packed_weights(laid) -> list:
    """The packed projections and head of laid-out params (cpu_matmul.Packed leaves)."""
    from kernels.cpu_matmul import Packed

    is_packed = lambda x: isinstance(x, Packed)  # noqa: E731
    return [w for w in jax.tree.leaves(laid, is_leaf=is_packed) if is_packed(w)]


def kept_share(laid) -> float:
    """The share of the packed weights' parameters that kept their 4-bit source grid (int8
    packing keeps a GGUF Q4 tensor's codes: kernels/cpu_matmul.py)."""
    ws = packed_weights(laid)
    size = lambda w: w.n * w.panels.shape[1]  # noqa: E731
    return sum(size(w) for w in ws if w.mins is not None) / max(sum(map(size, ws)), 1)


def best_of(f, args: tuple, repeats: int = 5, carry: bool = False) -> float:
    """The least of `repeats` timed calls of f(*args) after one untimed call, in seconds;
    `carry`: f gives (anything, a buffer its next call takes as its last argument: donated)."""
    args = list(args)
    best = float("inf")
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out = jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0) if i else best
        if carry:
            args[-1] = out[1]
    return best


def matmul_times(laid, rows: tuple[int, ...] = ROWS) -> list[float]:
    """The packed matmuls of one decode step (every projection and the head, one call) at
    each of `rows` rows, best of 5, in seconds: what the precision's weights cost a step."""
    from kernels import cpu_matmul

    untied = "lm_head" in laid  # then the embedding table is only read a row per token
    ws = packed_weights({k: v for k, v in laid.items() if not (untied and k == "embed")})
    f = jax.jit(lambda ws, xs: [cpu_matmul.matmul(x, w) for x, w in zip(xs, ws, strict=True)])
    return [best_of(f, (ws, [jnp.full((r, w.panels.shape[1]), 0.01, jnp.float32) for w in ws]))
            for r in rows]


@functools.cache
def attention_times(config, pages: str, rows: tuple[int, ...] = ROWS,
                    context: int = MAX_TOKENS) -> tuple[float, ...]:
    """One decode step's K/V writes and paged attention over every layer's own pages (a
    step reads them all: timed over one layer, its pages stay in cache), `rows` rows of
    `context` tokens each, with the pages in `pages`, best of 5, in seconds: what the
    pages' dtype costs a step, whatever the weights (timed once per process)."""
    from paged_jax.cache.kv_cache import init_kv_cache
    from paged_jax.models.attention import cached_attention, default_backend

    def step(batch, q, k, cache):
        kvs = [cached_attention(q, k, k, cache.layer(i), *batch, max_q=1,
                                backend=default_backend()) for i in range(config.num_layers)]
        return [o for o, _ in kvs], cache.with_buffers([kv for _, kv in kvs])

    block, n, out = 16, -(-context // 16), []
    for r in rows:
        tables = jnp.arange(1, r * n + 1, dtype=jnp.int32).reshape(r, n)
        batch = (tables[:, -1] * block + (context - 1) % block, tables,  # the newest tokens
                 jnp.full((r,), context, jnp.int32), jnp.arange(r + 1, dtype=jnp.int32))
        q = jnp.full((r, config.num_heads, config.head_dim), 0.01, jnp.float32)
        k = jnp.full((r, config.num_kv_heads, config.head_dim), 0.01, jnp.float32)
        cache = init_kv_cache(config.num_layers, config.num_kv_heads, r * n + 1, block,
                              config.head_dim, jnp.dtype(pages))
        out.append(best_of(jax.jit(step, donate_argnums=3), (batch, q, k, cache),
                           carry=True))
    return tuple(out)


def side(weights: str, pages: str) -> str:
    """A candidate's name: its weights, and its pages where they are not the weights' own."""
    return weights if pages == native_pages(weights) else f"{weights}, {pages} pages"


def candidates(paths: int, quantize: bool) -> list[tuple[str, str]]:
    """The (weights, pages) `choose` tries beside float32 on a kernel with these ISA paths:
    float32 weights over bfloat16 pages (half the K/V bytes a step reads), int8 (a 4-bit
    checkpoint's own codes: `quantize`) over either pages, bfloat16 (where the kernel has
    bfloat16 dot products)."""
    from kernels import cpu_matmul

    if not paths:
        return []
    weights = ["float32"] + ["int8"] * quantize + ["bfloat16"] * bool(
        paths & cpu_matmul.PATH_BF16_DOT)
    return [(w, p) for w in weights for p in ("float32", "bfloat16")
            if (w, p) != ("float32", "float32") and (w != "bfloat16" or p == "bfloat16")]


def measure(config, params, tokenizer, weights: str, pages: list[str]) -> dict[str, dict]:
    """The sides of one weight precision, by name (`side`), over each of `pages`: passage
    perplexity, matmul and attention times per ROWS, and `seconds` (the geometric mean over
    ROWS of the two). int8 also gives the share of weights that kept their 4-bit grid; under
    half, it is not the checkpoint's own bits and is not measured further."""
    laid = laid_out(params, weights)
    kept = dict(kept_grid=kept_share(laid)) if weights == "int8" else {}
    if kept and kept["kept_grid"] < 0.5:
        return {side(weights, p): dict(kept) for p in pages}
    mm, out = matmul_times(laid), {}
    for p in pages:
        at = attention_times(config, p)
        out[side(weights, p)] = dict(
            kept, perplexity=passage_perplexity(config, params, tokenizer, weights, laid, p),
            matmuls=mm, attention=list(at),
            seconds=float(np.exp(np.mean(np.log(np.add(mm, at))))))
    return out


def choose(config, params, tokenizer, key: str, quantize: bool = True) -> dict:
    """What `dtype="auto"` runs on this CPU (module docstring): dict(dtype, quantization,
    weights, kv_cache_dtype, reason, and what was measured), from the cache when this
    checkpoint and machine were checked before. `key` names the checkpoint (its file and
    size); `quantize`: int8 may be chosen (not when the user set matmul_backend="xla")."""
    tried = [("float32", "float32"), *candidates(kernel_paths(), quantize)]
    if len(tried) == 1:
        return dict(dtype="float32", quantization=None, weights="float32",
                    kv_cache_dtype="auto", reason="nothing to try beside float32: the C++ "
                    "kernels do not run here")
    path = cache_file()
    seen = json.loads(path.read_text()) if path.exists() else {}
    k = hashlib.sha256(f"{key}|{_machine()}|{METHOD}|{QUALITY}|{MAX_TOKENS}|{ROWS}|{tried}"
                       .encode()).hexdigest()[:20]
    if k not in seen:
        by_weights = {w: [p for v, p in tried if v == w] for w, _ in tried}
        seen[k] = verdict({n: m for w, ps in by_weights.items()
                           for n, m in measure(config, params, tokenizer, w, ps).items()})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(seen, indent=1))
        LOG.warning("dtype='auto' on this CPU: %s (%s)", seen[k]["side"], seen[k]["reason"])
    return seen[k]


def verdict(measured: dict) -> dict:
    """The fastest of the measured sides (by name: `side`) whose perplexity holds within
    QUALITY of float32's, and why."""
    f32 = measured["float32"]["perplexity"]
    held = {n: m for n, m in measured.items()
            if "perplexity" in m and m["perplexity"] <= f32 * (1 + QUALITY)}
    best = min(held, key=lambda n: held[n]["seconds"])
    why = [f"{n}: perplexity {m['perplexity']:.4f} "
           f"({'within' if n in held else 'past'} {QUALITY:.1%}), step's matmuls and "
           f"attention {m['seconds'] * 1e3:.2f} ms" if "perplexity" in m else
           f"{n}: {m['kept_grid']:.0%} of the weights on a 4-bit grid (not its own codes)"
           for n, m in measured.items()]
    weights, _, pages = best.partition(", ")
    return dict(dtype="bfloat16" if weights == "bfloat16" else "float32",
                quantization="int8" if weights == "int8" else None, weights=weights,
                kv_cache_dtype=pages.removesuffix(" pages") or "auto", side=best,
                measured=measured, reason=f"fastest within {QUALITY:.1%}: " + "; ".join(why))


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
