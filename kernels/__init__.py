"""Pallas (Triton) paged-attention kernels: a lab of variants, each file with a jnp reference
and a `__main__` checker/timer. The engine calls only `kernels.dispatch.paged_attention`
(through `paged_jax.models.attention.paged_attention(..., backend="pallas")`).

    pages.py                   what a kernel reads: pages as stored (float, int8 / fp8 + scales)
    paged_attention.py         decode: grouped | dot | split (flash-decoding)
    ragged_paged_attention.py  chunked prefill + decode in one ragged batch: grouped | dot
    dispatch.py                picks the variant from static shapes
    gpu_check.py               `make gpu-check`: compile, validate and time on a GPU
    gpu_validate.py            its correctness checks (every variant vs the reference)
"""
