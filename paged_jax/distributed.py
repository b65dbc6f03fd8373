"""One engine over several processes: `jax.distributed` joins them, and the tensor-parallel
mesh (paged_jax/models/parallel.py) spans every process's devices.

    python -m paged_jax.distributed --coordinator 127.0.0.1:PORT --num-processes 2 \\
        --process-id I [--model NAME_OR_PATH] [--prompt TEXT ...] [--out tokens.json]

Every process runs the same host program (multi-controller JAX): the same requests, the same
scheduler decisions (they are deterministic), the same jitted steps; XLA's collectives (gloo
on CPU) carry the all-reduces between processes. Outputs are replicated, so each process
reads them locally; process 0 prints them and writes --out. Swap preemption reads blocks to
the host and needs every shard local, so it is refused here (recompute preemption works).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax

from paged_jax.llm import LLM
from paged_jax.sampling_params import SamplingParams


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Joins this process to the others (CPU: gloo collectives between processes)."""
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def greedy_tokens(llm: LLM, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    """Each prompt's greedy tokens (exactly max_tokens: EOS ignored)."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def write_result(path: Path | None, tokens: list[list[int]]) -> None:
    """Process 0 records what the mesh computed (devices, processes, tokens)."""
    if jax.process_index() == 0 and path is not None:
        path.write_text(json.dumps(dict(devices=jax.device_count(),
                                        processes=jax.process_count(), tokens=tokens)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--coordinator", required=True, help="host:port of process 0")
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--model", default=None, help="short name, .gguf or HF folder (default: "
                    "SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None, help="process 0 writes tokens here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    initialize(a.coordinator, a.num_processes, a.process_id)
    llm = LLM(a.model, tensor_parallel_size=jax.device_count())
    prompts = a.prompt or ["The capital of France is"]
    tokens = greedy_tokens(llm, prompts, a.max_tokens)
    if jax.process_index() == 0:
        for p, t in zip(prompts, tokens, strict=True):
            print(f"{p!r} -> {llm.get_tokenizer().decode(t)!r}")
    write_result(a.out, tokens)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
