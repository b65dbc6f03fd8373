"""Labels for open prompts: how likely each model finds a reference answer.

An open question ("What is a fjord?") has many right answers, so a completion cannot be
checked by string. Instead each model scores the reference answer after the prompt (one
prefill with `prompt_logprobs`), as a mean log-probability per byte of the reference: per
byte, not per token, because the two models' tokenizers cut the text differently. A model
"knows" the answer when its score is at least the median of both models' scores over the
open set; that binary label joins the checked families' right / wrong labels.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paged_jax.llm import LLM
from paged_jax.sampling_params import SamplingParams


def reference_logprob(llm: LLM, prompts: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """[N] mean log-probability per byte that `llm` gives each reference right after its
    prompt. Tokens the prompt and prompt + reference share are not scored; the bytes of
    every scored token are counted (a token that merges across the seam counts whole)."""
    tok = llm.get_tokenizer()
    texts = [p + r for p, r in zip(prompts, references, strict=True)]
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(texts, sp, use_tqdm=False)
    scores = []
    for p, o in zip(prompts, outs, strict=True):
        ids, head = o.prompt_token_ids, tok.encode(p)
        k = next((i for i, (a, b) in enumerate(zip(ids, head, strict=False)) if a != b),
                 min(len(ids), len(head)))
        k = max(k, 1)  # the first token has no logprob
        total = sum(o.prompt_logprobs[i][ids[i]].logprob for i in range(k, len(ids)))
        scores.append(total / max(1, len(tok.decode(ids[k:]).encode())))
    return np.array(scores, np.float32)


def labels(scores: np.ndarray) -> tuple[np.ndarray, float]:
    """([N, M] 0/1 labels, the cut): a model knows an answer when its score [N, M] is at
    least the median of every model's scores."""
    cut = float(np.median(scores))
    return (scores >= cut).astype(np.float32), cut
