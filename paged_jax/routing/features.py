"""What the router knows about a request before choosing a model: how the weak model began to
answer it, plus cheap features of the prompt text.

The router lets the weak model start: its prefill, then up to `WINDOW` output tokens (or its
whole answer, when that is shorter), each with its top `TOP_K` logprobs
(`SamplingParams(logprobs=TOP_K)`), and the prompt's last hidden state (after the final norm:
the vector the first output token is read from, `return_hidden_states=True`). Reading a few
tokens of the answer is what a cascade reads (FrugalGPT: a weak answer the weak model is unsure
of is the one to send on); on these short questions, reading 8 tokens instead of the first
one more than doubled the cost saved on this CPU (results/routing.json, "window"), while on
a GPU, where decoding is what costs, the first token is the cheaper probe. The hidden state
is the pooled representation of the prompt, as Hugging Face's sequence-classification heads
on decoder models pool it; the head projects it on a few principal components (routing/head.py).

    top1, margin, entropy, top_mass     the first position: its top logprob, top1 minus the
                                        runner-up, the top-K entropy (renormalized), the log
                                        of the probability the top K hold together
    answer_mean, answer_min             the chosen tokens' logprobs over the window
    answer_margin_min                   the smallest top1 - runner-up margin in it
    answer_tokens, answer_done          how many tokens it holds; 1 if the answer ended in it

The prompt's last line (the question) gives the rest: its length in characters and words, how
many digits it holds and the longest run of them, and how many list separators it has. No
feature names a task family, so a router trained on some families can be tried on others.
A request's raw features are the `NAMES` (in order), then the hidden state.
"""

from __future__ import annotations

import math
import re

import numpy as np

from paged_jax.outputs import Logprob, RequestOutput

TOP_K = 20
WINDOW = 8  # output tokens of the weak model read before routing (fewer if it ends sooner)
FIRST = ("top1", "margin", "entropy", "top_mass")
ANSWER = ("answer_mean", "answer_min", "answer_margin_min", "answer_tokens", "answer_done")
PROMPT = ("chars", "words", "digits", "longest_number", "separators")
NAMES = FIRST + ANSWER + PROMPT
PROMPT_COLUMNS = tuple(range(len(FIRST) + len(ANSWER), len(NAMES)))  # text alone


def _ranked(position: dict[int, Logprob]) -> list[float]:
    """One position's logprobs, best first."""
    return sorted((x.logprob for x in position.values()), reverse=True)


def logprob_features(first: dict[int, Logprob]) -> list[float]:
    """The four features of the first output position's top logprobs."""
    lps = _ranked(first)[:TOP_K]
    second = lps[1] if len(lps) > 1 else lps[0] - 20.0
    mass = math.log(sum(math.exp(x) for x in lps))
    probs = [math.exp(x - mass) for x in lps]
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    return [lps[0], lps[0] - second, entropy, mass]


def answer_features(positions: list[dict[int, Logprob]], token_ids: list[int],
                    done: bool) -> list[float]:
    """The five features of the answer's first positions (the window): `token_ids` are the
    tokens chosen there, `done` whether the answer ended within them."""
    chosen = [pos[t].logprob for pos, t in zip(positions, token_ids, strict=True)]
    margins = [lps[0] - lps[1] if len(lps) > 1 else 20.0 for lps in map(_ranked, positions)]
    return [float(np.mean(chosen)), min(chosen), min(margins), float(len(chosen)), float(done)]


def prompt_features(prompt: str) -> list[float]:
    """The cheap features of a prompt's last non-empty line (its question)."""
    lines = [x for x in prompt.strip().split("\n") if x.strip()]
    q = lines[-2] if len(lines) > 1 and lines[-1].strip() in ("A:", "Answer:") else lines[-1]
    numbers = re.findall(r"\d+", q)
    return [math.log1p(len(q)), math.log1p(len(q.split())), float(sum(map(len, numbers))),
            float(max(map(len, numbers), default=0)), float(q.count(";") + q.count(","))]


def prompt_only(prompt: str) -> np.ndarray:
    """A request's raw named features before any model ran: the prompt's, zeros for the
    answer's (the prompt head reads only PROMPT_COLUMNS)."""
    x = np.zeros(len(NAMES), np.float32)
    x[list(PROMPT_COLUMNS)] = prompt_features(prompt)
    return x


def ready(out: RequestOutput, window: int = WINDOW) -> bool:
    """Whether the weak model's output has told the router all it will read: `window` tokens,
    or the whole answer."""
    n = len(out.outputs[0].token_ids) if out.outputs else 0
    return n > 0 and (out.finished or n >= window)


def features(prompt: str, out: RequestOutput, window: int = WINDOW) -> np.ndarray:
    """One request's raw features (float32) from the weak model's output (asked with top
    logprobs; `ready`): `NAMES` in order, then its hidden state [E] when it carries one. Only
    the first `window` positions are read, however many the output holds."""
    c = out.outputs[0]
    # the same length: a server reads a running output the engine thread may still extend
    n = min(window, len(c.token_ids), len(c.logprobs))
    ids, positions = list(c.token_ids[:n]), list(c.logprobs[:n])
    done = out.finished and len(c.token_ids) <= window
    named = np.asarray(logprob_features(positions[0]) + answer_features(positions, ids, done)
                       + prompt_features(prompt), np.float32)
    hidden = out.hidden_states
    return named if hidden is None else np.concatenate([named, np.asarray(hidden, np.float32)])
