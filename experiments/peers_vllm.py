"""vLLM (CPU build) on the peers workload: run by `make peers` inside its own venv.

    .venv-vllm/bin/python -m experiments.peers_vllm [--prompts 64] [--tokens 128]
                                                    [--dtypes float32 bfloat16] [--batch 16]

vLLM loads Hugging Face folders, so the default GGUF is first exported once to a safetensors
folder (transformers dequantizes it; cached next to paged-jax's params). Same prompts as
experiments/peers.py (our chat template + tokenizer, passed as token ids), greedy, ignore_eos,
exactly --tokens outputs, at most --batch running sequences; the clock starts after a warm-up.
Prints and saves output tokens/s to results/peers_vllm.json, next to paged-jax's and HF's
numbers from results/peers.json when that file exists. Nothing is downloaded at run time
(HF_HUB_OFFLINE=1). Not part of the tests: vllm is not a dependency of paged-jax.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

# vLLM's CPU backend reserves a core for its own threads unless told not to; both are ours.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def export_hf_folder() -> Path:
    """The default GGUF as a Hugging Face safetensors folder (written once, then reused)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paged_jax.compile_cache import cache_root
    from paged_jax.models import default_model_path
    from paged_jax.models.param_cache import fingerprint

    gguf = default_model_path()
    out = cache_root() / f"hf-export-{fingerprint([gguf])}"
    if not (out / "model.safetensors").exists():
        kw = dict(gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kw)
        # transformers marks GGUF-loaded models "quantized" and refuses to save them, but the
        # tensors are already dequantized to plain fp32: drop the marker and save those.
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(gguf.parent), **kw).save_pretrained(out)
    return out


def run(folder: Path, ids: list[list[int]], tokens: int, dtype: str, batch: int) -> float:
    """Output tokens/s of vLLM's offline `generate` on the prompts (after a warm-up)."""
    from vllm import LLM, SamplingParams  # the vllm venv only

    llm = LLM(model=str(folder), dtype=dtype, max_model_len=512, max_num_seqs=batch,
              enable_prefix_caching=False, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ids]
    llm.generate(prompts[:batch], SamplingParams(temperature=0.0, max_tokens=4,
                                                 ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    del llm
    return len(ids) * tokens / dt


def main(prompts: int = 64, tokens: int = 128, dtypes=("float32", "bfloat16"),
         batch: int = 16) -> dict:
    from experiments.common import RESULTS, save_json, table
    from experiments.peers import chat_ids
    from paged_jax.models import load_model

    ids = chat_ids(load_model(None)[2], prompts)
    folder = export_hf_folder()
    ours = _ours(RESULTS / "peers.json", prompts, tokens)
    rows = []
    for dtype in dtypes:
        tps = run(folder, ids, tokens, dtype, batch)
        row = dict(dtype=dtype, vllm_tok_s=tps, **ours.get(dtype, {}))
        if "paged_jax_tok_s" in row:
            row["paged_jax_over_vllm"] = row["paged_jax_tok_s"] / tps
        rows.append(row)
    payload = dict(config=dict(prompts=prompts, tokens=tokens, batch=batch, greedy=True,
                               ignore_eos=True, model=str(folder)), rows=rows)
    save_json("peers_vllm", payload)
    print(table(rows, ["dtype", "vllm_tok_s", "paged_jax_tok_s", "hf_tok_s",
                       "paged_jax_over_vllm"]))
    return payload


def _ours(path: Path, prompts: int, tokens: int) -> dict:
    """paged-jax's and HF's tok/s from results/peers.json, if it measured the same workload."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    cfg = data.get("config", {})
    if (cfg.get("prompts"), cfg.get("tokens")) != (prompts, tokens):
        return {}
    return {r["dtype"]: dict(paged_jax_tok_s=r["paged_jax_tok_s"], hf_tok_s=r["hf_tok_s"])
            for r in data["rows"] if r.get("model", "smollm2") == "smollm2"}


if __name__ == "__main__":
    from experiments.peers import workload_args

    main(**vars(workload_args(__doc__.splitlines()[0]).parse_args()))
