"""The one paged-attention entry point the model calls.

A step's queries are a ragged batch: a flat run of T tokens in which sequence s owns
``q[query_start[s]:query_start[s+1]]``, the *last* ``num_q[s]`` tokens of its context of
``seq_lens[s]`` tokens (their K/V are already written to the cache). Query i of sequence s sits
at position ``seq_lens[s] - num_q[s] + i`` and attends causally to keys 0..that position.
Tokens past ``query_start[S]`` are padding and get zeros.

    decode:         num_q = 1 for every sequence                    (max_q = 1)
    chunked prefill: num_q = chunk, seq_lens = cached + chunk      (max_q = chunk bucket)

A small switch over the kernel lab (kernels/, which imports nothing from paged_jax):
"reference" (kernels/reference.py, pure jnp, any platform: the oracle every kernel is tested
against), "pallas" (on GPU the kernels dispatch.py picks, interpret mode elsewhere; "pallas-triton"
and "pallas-mosaic" force decode's kernel: Triton, or Mosaic GPU where it takes the shapes)
and "cpu" (kernels/cpu_attention:
a C++ kernel through XLA's FFI, built on first use). `default_backend()` picks by platform.
"""

from __future__ import annotations

import jax

from kernels import cpu_attention
from kernels import reference as ref
from kernels.pages import PagesLike as Pages
from kernels.reference import flat_decode_reference, ragged_reference, tiled_reference
from paged_jax import compile_cache
from paged_jax.cache import kv_cache as kv_lib
from paged_jax.cache import kv_quant
from paged_jax.types import Array, Float, Int

__all__ = ["BACKENDS", "cached_attention", "default_backend", "paged_attention",
           "ragged_reference", "tiled_reference", "flat_decode_reference"]

BACKENDS = ("reference", "pallas", "pallas-triton", "pallas-mosaic", "cpu")


def default_backend() -> str:
    """"pallas" on GPU; on CPU "cpu" when its kernel builds, else "reference" (Pallas
    interpret mode is for testing, not speed)."""
    if jax.default_backend() == "gpu":
        return "pallas"
    return "cpu" if cpu_kernel_available() else "reference"


def cpu_kernel_available() -> bool:
    """Whether the C++ CPU kernel is built and registered (builds it on the first call)."""
    return cpu_attention.load(str(compile_cache.kernel_folder()))


def paged_attention(
    q: Float[Array, "T Q D"],
    k_pages: Pages,
    v_pages: Pages,
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    query_start: Int[Array, "S+1"],
    *,
    max_q: int,
    backend: str = "reference",
    scale: float | None = None,
    max_q_rows: int | None = None,
    decode_pages: int | None = None,
    window: int | None = None,
) -> Float[Array, "T Q D"]:
    """Causal attention of a ragged batch of queries over the paged KV cache.

    Args:
      q: [T, Q, D] queries, Q = H * G (grouped-query attention: query head j uses KV head j // G).
      k_pages, v_pages: one layer of the cache: [H, N, K, D] float pages, a pair (int8 / fp8
        values [H, N, K, D], scales [H, N, K, Z], one per D / Z values), or kernels.pages.Pages
        (the engine's, bfloat16 / fp8 stored as their bits).
      block_tables: [S, P] physical block of each logical block; padding entries are 0.
      seq_lens: [S] context length per sequence including this step's tokens (0 = padding).
      query_start: [S + 1] offsets of each sequence's queries in q (cumulative, nondecreasing).
      max_q: static bound on any sequence's query count (1 for decode).
      backend: one of BACKENDS.
      scale: softmax scale; default 1/sqrt(D).
      max_q_rows: static hint: only the first `max_q_rows` sequences may have more than one
        query (prefill chunks first, decodes after). The reference then pads only those rows
        to max_q; the Pallas kernels are ragged and ignore it. None: any row may.
      decode_pages: static bound on the pages held by all single-query rows together (the
        reference's flat page list, see `flat_decode_reference`); None: every row's P pages.
      window: static sliding window (Gemma 3's local layers): a query at position i sees
        keys i - window + 1 .. i only (the kernels skip earlier pages); None: all.

    Returns:
      [T, Q, D] attention output, zeros for padding tokens.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if backend == "reference":
        return ref.split_reference(
            q, k_pages, v_pages, block_tables, seq_lens, query_start, max_q, scale, max_q_rows,
            decode_pages, window,
        )
    if backend == "cpu":
        if not cpu_kernel_available():
            raise ValueError("attention backend 'cpu' needs its C++ kernel, which did not build "
                             "(see the warning above); use backend='reference'")
        return cpu_attention.paged_attention(
            q, k_pages, v_pages, block_tables, seq_lens, query_start, scale=scale,
            window=window)
    if backend.startswith("pallas") and backend in BACKENDS:
        from kernels import dispatch  # Pallas loads only when asked for

        return dispatch.paged_attention(
            q, k_pages, v_pages, block_tables, seq_lens, query_start, max_q=max_q, scale=scale,
            window=window, decode_kernel=backend.partition("-")[2] or "auto",
        )
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")


def cached_attention(
    q: Float[Array, "T Q D"],
    k: Float[Array, "T H D"],
    v: Float[Array, "T H D"],
    kv: tuple[Pages, Pages],
    cache_positions: Int[Array, "T"],
    block_tables: Int[Array, "S P"],
    seq_lens: Int[Array, "S"],
    query_start: Int[Array, "S+1"],
    **attn,
) -> tuple[Float[Array, "T Q D"], tuple[Pages, Pages]]:
    """One layer's step on the paged cache: the new tokens' K/V written at their cache
    positions, then `paged_attention` (its keyword arguments in `attn`) over the pages. The
    one path every decoder takes, our functions' and a user's Flax module's (paged_jax/nn):
    int8 pages hold K/V rotated (kv_quant.rotation), so q, k, v are rotated on the way in and
    the output rotated back.

    Returns:
      ([T, Q, D] attention output, the layer's (K, V) pages with this step's tokens).
    """
    spin = kv_quant.rotation(kv[0].dtype, q.shape[-1])
    if spin is not None:
        q, k, v = (y @ spin.astype(y.dtype) for y in (q, k, v))
    with jax.named_scope("kv_write"):  # named scopes: experiments/step_profile.py's kinds
        kv = kv_lib.write_layer(*kv, cache_positions, k, v)
    with jax.named_scope("attention"):
        o = paged_attention(q, *kv, block_tables, seq_lens, query_start, **attn)
    if spin is not None:
        o = o @ spin.T.astype(o.dtype)
    return o, kv
