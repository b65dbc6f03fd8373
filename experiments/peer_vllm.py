"""vLLM's CPU build as a side of `make bench`: a worker in its own venv (`make peers`).

    .venv-vllm/bin/python experiments/peer_vllm.py --model smollm2 --dtype float32 \\
        [--prefix-caching] [--max-seqs 64] [--max-tokens-per-step 512] [--max-len 512] \\
        [--kv-gib 1]

vLLM loads Hugging Face folders, so the shipped GGUF is first exported once to a safetensors
folder (transformers dequantizes it; cached next to paged-jax's params). Commands and answers
are JSON lines (experiments/peer_protocol.py): each run is one offline `LLM.generate` of the
given token ids, greedy, exactly N tokens (ignore_eos). Nothing is downloaded
(HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# vLLM's CPU backend reserves a core for its own threads unless told not to; both are ours.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))
import peer_protocol  # noqa: E402

peer_protocol.quiet()  # vLLM logs to stdout: only answers may go there


def export_hf_folder(model: str | None = None) -> Path:
    """A shipped GGUF as a Hugging Face safetensors folder (written once, then reused)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paged_jax.compile_cache import cache_root
    from paged_jax.models import model_path
    from paged_jax.models.param_cache import fingerprint

    gguf = model_path(model)
    out = cache_root() / f"hf-export-{fingerprint([gguf])}"
    if not (out / "model.safetensors").exists():
        kw = dict(gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kw)
        # transformers marks GGUF-loaded models "quantized" and refuses to save them, but the
        # tensors are already dequantized to plain fp32: drop the marker and save those.
        hf.hf_quantizer = None
        hf.config.__dict__.pop("quantization_config", None)
        hf.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(gguf.parent), **kw).save_pretrained(out)
    return out


def generate(llm, cmd: dict) -> dict:
    """The "generate" op (experiments/structured_outputs.py): greedy, each prompt with its own
    max_tokens and structured-output constraint (vLLM's StructuredOutputsParams fields; None:
    unconstrained, ignore_eos, exactly max_tokens)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=c is None,
                          structured_outputs=None if c is None else StructuredOutputsParams(**c))
           for n, c in zip(cmd["max_tokens"], cmd["constraints"], strict=True)]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], sps, use_tqdm=False)
    return dict(seconds=time.perf_counter() - t0,
                tokens=[list(o.outputs[0].token_ids) for o in outs],
                texts=[o.outputs[0].text for o in outs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--max-tokens-per-step", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=32)  # vLLM CPU: multiples of 32
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--structured-backend", default="auto",
                    help="vLLM's structured_outputs_config backend (auto, xgrammar, guidance)")
    a = ap.parse_args()
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(a.kv_gib)
    from importlib import metadata

    from vllm import LLM, SamplingParams  # the vllm venv only

    settings = dict(dtype=a.dtype, max_num_seqs=a.max_seqs,
                    max_num_batched_tokens=a.max_tokens_per_step, max_model_len=a.max_len,
                    block_size=a.block_size, enable_prefix_caching=a.prefix_caching,
                    kv_cache_gib=a.kv_gib)
    llm = LLM(model=str(export_hf_folder(a.model)), dtype=a.dtype, max_model_len=a.max_len,
              max_num_seqs=a.max_seqs, max_num_batched_tokens=a.max_tokens_per_step,
              block_size=a.block_size, enable_prefix_caching=a.prefix_caching, seed=0,
              structured_outputs_config={"backend": a.structured_backend})

    def run(cmd: dict) -> dict:
        if cmd.get("op") == "generate":
            return generate(llm, cmd)
        sp = SamplingParams(temperature=0.0, max_tokens=cmd["tokens"], ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], sp,
                            use_tqdm=False)
        return dict(seconds=time.perf_counter() - t0,
                    tokens=[list(o.outputs[0].token_ids) for o in outs])

    peer_protocol.serve(run, versions=dict(vllm=metadata.version("vllm-cpu"),
                                           torch=metadata.version("torch")), settings=settings)


if __name__ == "__main__":
    main()
