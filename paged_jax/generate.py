"""A chat answer from a model through the engine: `python -m paged_jax.generate --prompt "..."`.
"""

from __future__ import annotations

import argparse
import sys
import time

from paged_jax.llm import LLM
from paged_jax.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", required=True, help="user message (the chat template is applied)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default=None,
                   help="short name, .gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the prompt")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    t1 = time.perf_counter()
    if args.raw:
        out = llm.generate(args.prompt, sp, use_tqdm=False)[0]
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        out = llm.chat(messages, sp, use_tqdm=False)[0]
    t2 = time.perf_counter()
    print(out.outputs[0].text)
    print(f"[load {t1 - t0:.1f}s, {len(out.outputs[0].token_ids)} tokens in {t2 - t1:.1f}s "
          "(incl. compile)]", file=sys.stderr)


if __name__ == "__main__":
    main()
