"""The Hugging Face baseline: transformers' `generate()` on the default model, static batches.

The SmolLM2-135M-Instruct GGUF is dequantized by transformers itself (about 30 s, once per
process), so both sides serve the same weights. Batches are left-padded, greedy, and run for
exactly the tokens asked (`min_new_tokens`), as `ignore_eos` does on our side. A static batch
runs until its longest request is done: shorter requests ride along as padding, which is the
waste continuous batching removes.
"""

from __future__ import annotations

import functools
import os
import time


@functools.cache
def model(dtype: str = "float32", name: str = "smollm2"):
    """A shipped GGUF (paged_jax.models.loader.SHIPPED_MODELS; the default model unless
    `name` says otherwise) as a transformers model on CPU (cached per process)."""
    import sys

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from paged_jax.models import model_path

    torch.set_num_threads(os.cpu_count() or 1)
    if not sys.stderr.isatty():  # its loading bars would flood a log file
        hf_logging.disable_progress_bar()
    path = model_path(name)
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name,
        dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]).eval()


def generate(hf_model, prompts: list[list[int]], new_tokens: int, pad: int) -> list[list[int]]:
    """One static batch: every prompt gets exactly `new_tokens` greedy tokens."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    return out[:, width:].tolist()


def static_batches(hf_model, prompts: list[list[int]], out_lens: list[int], batch: int,
                   pad: int) -> dict:
    """Requests in arrival order, `batch` at a time, each batch run to its longest output.

    Returns:
      seconds, useful output tokens (each request's own length), generated tokens (padding
      rows included) and the first-16 tokens of each request (for agreement checks).
    """
    t0, useful, made, firsts = time.perf_counter(), 0, 0, []
    for i in range(0, len(prompts), batch):
        lens = out_lens[i:i + batch]
        out = generate(hf_model, prompts[i:i + batch], max(lens), pad)
        useful += sum(lens)
        made += len(lens) * max(lens)
        firsts += [row[:min(16, n)] for row, n in zip(out, lens, strict=True)]
    return dict(seconds=time.perf_counter() - t0, useful_tokens=useful, generated_tokens=made,
                first16=firsts)
