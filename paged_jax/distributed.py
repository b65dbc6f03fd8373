"""One engine over several processes: `jax.distributed` joins them, and the tensor-parallel
mesh (paged_jax/parallel.py) spans every process's devices.

    python -m paged_jax.distributed --coordinator 127.0.0.1:PORT --num-processes 2 \\
        --process-id I [--model tiny | PATH] [--out tokens.json]

Every process runs the same host program (multi-controller JAX): the same requests, the same
scheduler decisions (they are deterministic), the same jitted steps; XLA's collectives (gloo
on CPU) carry the all-reduces between processes. Outputs are replicated, so each process
reads them locally; process 0 writes them. Swap preemption reads blocks to the host and
needs every shard local, so it is refused here (recompute preemption works).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Joins this process to the others (CPU: gloo collectives between processes)."""
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


PROMPTS = ["the first request", "a second, longer request with more words in it",
           "three", "and a fourth one that runs a little longer than the others do"]


def tiny_llm(tensor_parallel_size: int):
    """The tests' tiny random model (seeded: the same weights in every process)."""
    from paged_jax import LLM
    from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config

    cfg = tiny_config()
    return LLM(model_parts=(cfg, random_params(cfg), byte_tokenizer()), block_size=8,
               num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
               tensor_parallel_size=tensor_parallel_size)


def greedy_tokens(llm, max_tokens: int = 16) -> list[list[int]]:
    from paged_jax import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--coordinator", required=True, help="host:port of process 0")
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--out", type=Path, default=None, help="process 0 writes tokens here")
    a = ap.parse_args(argv)
    initialize(a.coordinator, a.num_processes, a.process_id)
    n = jax.device_count()
    tokens = greedy_tokens(tiny_llm(n))
    if a.process_id == 0 and a.out is not None:
        a.out.write_text(json.dumps(dict(devices=n, processes=jax.process_count(),
                                         tokens=tokens)))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
