"""Pallas paged-attention kernels (Triton and Mosaic GPU): a lab of variants, each file with a
jnp reference and a `__main__` checker/timer. The engine calls only
`kernels.dispatch.paged_attention` (through `paged_jax.models.attention.paged_attention(...,
backend="pallas")`).

    pages.py                   what a kernel reads: pages as stored (float, int8 / fp8 + scales)
    paged_attention.py         decode on Triton: grouped | dot | split | split_dot, one page or
                               several gathered per loop step
    mosaic_decode.py           decode on Mosaic GPU (Hopper: TMA into shared memory, wgmma)
    ragged_paged_attention.py  chunked prefill + decode in one ragged batch: grouped | dot
    lora_pallas.py             the batched LoRA delta of a mixed-adapter batch (tiles of one slot)
    dispatch.py                picks the kernel and variant from static shapes
    gpu_check.py               the kernel half of `make gpu-check` (experiments/gpu_check.py)
    gpu_timing.py              its paired-round timing and the copy-bandwidth limit
    gpu_validate.py            its correctness checks (every variant vs the reference)
"""
