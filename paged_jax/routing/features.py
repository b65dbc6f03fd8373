"""What the router knows about a request before choosing a model: features of the weak model's
own prefill plus cheap features of the prompt text.

The weak model's prefill ends in its last hidden state (after the final norm), the vector
its first output token is read from (`SamplingParams(return_hidden_states=True)`): the
pooled representation of the prompt, as Hugging Face's sequence-classification heads on
decoder models pool it (the last token). The head projects it on a few principal components
(routing/head.py). Its top `TOP_K` logprobs (`SamplingParams(logprobs=TOP_K)`) say how sure
the weak model is:

    top1         logprob of its most likely first token
    margin       top1 minus the runner-up's logprob
    entropy      entropy of the top-K distribution, renormalized
    top_mass     log of the probability the top K hold together

The prompt's last line (the question) gives the rest: its length in characters and words,
how many digits it holds and the longest run of them, and how many list separators it has.
No feature names a task family, so a router trained on some families can be tried on others.
A request's raw features are the `NAMES` (in order), then the hidden state.
"""

from __future__ import annotations

import math
import re

import numpy as np

from paged_jax.outputs import Logprob

TOP_K = 20
NAMES = ("top1", "margin", "entropy", "top_mass",
         "chars", "words", "digits", "longest_number", "separators")


def logprob_features(first: dict[int, Logprob]) -> list[float]:
    """The four weak-model features from the first output position's top logprobs."""
    lps = sorted((x.logprob for x in first.values()), reverse=True)[:TOP_K]
    second = lps[1] if len(lps) > 1 else lps[0] - 20.0
    mass = math.log(sum(math.exp(x) for x in lps))
    probs = [math.exp(x - mass) for x in lps]
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    return [lps[0], lps[0] - second, entropy, mass]


def prompt_features(prompt: str) -> list[float]:
    """The cheap features of a prompt's last non-empty line (its question)."""
    lines = [x for x in prompt.strip().split("\n") if x.strip()]
    q = lines[-2] if len(lines) > 1 and lines[-1].strip() in ("A:", "Answer:") else lines[-1]
    numbers = re.findall(r"\d+", q)
    return [math.log1p(len(q)), math.log1p(len(q.split())), float(sum(map(len, numbers))),
            float(max(map(len, numbers), default=0)), float(q.count(";") + q.count(","))]


def features(prompt: str, first: dict[int, Logprob],
             hidden: np.ndarray | None = None) -> np.ndarray:
    """One request's raw features (float32): `NAMES` in order, then the weak model's hidden
    state [E] when given."""
    named = np.asarray(logprob_features(first) + prompt_features(prompt), np.float32)
    return named if hidden is None else np.concatenate([named, np.asarray(hidden, np.float32)])
