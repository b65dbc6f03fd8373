"""Two tiny models and a head for routing tests (offline and behind the server)."""

from __future__ import annotations

import numpy as np

from paged_jax import LLM, SamplingParams
from paged_jax.models.testing import byte_tokenizer, random_params, tiny_config
from paged_jax.outputs import CompletionOutput, Logprob, RequestOutput
from paged_jax.routing import features as feat
from paged_jax.routing import head as head_lib

PROMPTS = [f"Q: {'word ' * (i % 6)}{i}?\nA:" for i in range(10)]
SP = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def top(lps: list[float]) -> dict:
    """A position's logprobs, ranked in the given order."""
    return {i: Logprob(lp, rank=i + 1) for i, lp in enumerate(lps)}


def answered(prompt: str, positions: list[list[float]], hidden=None,
             finished: bool = True) -> RequestOutput:
    """A weak model's output as the router reads it: each position's ranked logprobs (the
    top one chosen), and optionally the prompt's hidden state."""
    tops = [top(lps) for lps in positions]
    c = CompletionOutput(0, "x" * len(tops), [0] * len(tops), None, tops,
                         "stop" if finished else None)
    return RequestOutput("r", prompt, [1, 2], [c], finished, None, hidden_states=hidden)


def tiny_pair() -> tuple[LLM, LLM, head_lib.Head]:
    """Two tiny models with different weights, and a head that sends long questions to the
    strong one (its gain grows with the question's length), reading a window of 2 tokens."""
    cfg, tok = tiny_config(), byte_tokenizer()
    weak, strong = (LLM(model_parts=(cfg, random_params(cfg, seed=s), tok), max_num_seqs=8,
                        max_num_batched_tokens=128, max_model_len=1100, block_size=8,
                        num_kv_blocks=1200, static_shapes=True) for s in (0, 1))
    f = len(feat.NAMES)
    w2 = np.zeros((head_lib.HIDDEN, 2), np.float32)
    w2[0, 1] = 4.0
    params = dict(w1=np.zeros((f, head_lib.HIDDEN), np.float32), b1=np.zeros(
        head_lib.HIDDEN, np.float32), w2=w2, b2=np.zeros(2, np.float32))
    params["w1"][feat.NAMES.index("chars"), 0] = 1.0
    x = np.stack([feat.features(p, answered(p, [[-1.0, -2.0]])) for p in PROMPTS])
    # routed after 2 of SP's 6 tokens: a moved request leaves the weak model mid-answer
    head = head_lib.Head(params, x.mean(0), x.std(0) + 1e-3, np.ones(2, np.float32), feat.NAMES,
                         metrics=dict(window=2))
    return weak, strong, head


def median_threshold(head: head_lib.Head) -> float:
    """A threshold that sends about half of PROMPTS to the strong model."""
    x = np.stack([feat.features(p, answered(p, [[-1.0, -2.0]])) for p in PROMPTS])
    return float(np.median(head.gain(x)))
