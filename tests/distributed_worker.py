"""One process of tests/test_distributed.py: the tests' tiny model over jax.distributed.

    python -m tests.distributed_worker --coordinator HOST:PORT --num-processes 2 \\
        --process-id I --out tokens.json
"""

from __future__ import annotations

import jax

from paged_jax.distributed import greedy_tokens, initialize, parse_args, write_result
from paged_jax.llm import LLM
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config

PROMPTS = ["the first request", "a second, longer request with more words in it",
           "three", "and a fourth one that runs a little longer than the others do"]


def tiny_llm(tensor_parallel_size: int) -> LLM:
    """The tests' tiny random model (seeded: the same weights in every process)."""
    cfg = tiny_config()
    return LLM(model_parts=(cfg, random_params(cfg), byte_tokenizer()), block_size=8,
               num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
               tensor_parallel_size=tensor_parallel_size)


if __name__ == "__main__":
    a = parse_args()
    initialize(a.coordinator, a.num_processes, a.process_id)
    write_result(a.out, greedy_tokens(tiny_llm(jax.device_count()), PROMPTS))
    jax.distributed.shutdown()
