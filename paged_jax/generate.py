"""Greedy chat answer from a model: `python -m paged_jax.generate --prompt "..."`.

A simple host loop over the paged cache (models/runner.py), not the serving engine.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax.numpy as jnp

from paged_jax.attention import default_backend
from paged_jax.models import load_model
from paged_jax.models.runner import greedy, runner_for


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", required=True, help="user message (the chat template is applied)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default=None, help=".gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the prompt")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    config, params, tok = load_model(args.model, dtype=jnp.dtype(args.dtype))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    text = args.prompt if args.raw else tok.apply_chat_template(messages)
    ids = tok.encode(text)
    runner = runner_for(config, params, 1, len(ids) + args.max_tokens, backend=default_backend())
    t1 = time.perf_counter()
    (out,), _ = greedy(runner, [ids], args.max_tokens, stop_ids=tok.eos_token_ids)
    t2 = time.perf_counter()
    print(tok.decode(out))
    print(f"[load {t1 - t0:.1f}s, {len(out)} tokens in {t2 - t1:.1f}s (incl. compile)]",
          file=sys.stderr)


if __name__ == "__main__":
    main()
