"""Synthetic serving workloads fitted to the vLLM paper's datasets (seeded, CPU-sized).

Lengths. The paper (Kwon et al., SOSP'23, Sec. 6.1 and Fig. 11) samples requests from two
datasets; the means it reports are our targets:

    dataset    mean input  mean output   spread (ours)                 shape
    ShareGPT     161.31      337.99      lognormal sigma 1.0 (CV 1.31)  long tail (real chats)
    Alpaca        19.31       58.45      lognormal sigma 0.7 (CV 0.79)  short instructions

The paper gives means and histograms, not parameters, so the shape is our choice: lognormal,
mu = ln(mean * scale) - sigma^2 / 2 so that E[length] = mean * scale exactly before clipping.
ShareGPT's histogram (Fig. 11a) is long-tailed over 0..2000 tokens, hence a wide sigma;
Alpaca's (Fig. 11b) is narrow and short. `scale` shrinks both lengths so runs fit a CPU
(e.g. 0.25: ShareGPT-like means of 40 / 84 tokens). Lengths are clipped to [1, cap] where
the prompt gets at most half of max_model_len and the output the rest (clipping lowers the
mean slightly when the cap is near the tail; `describe` reports the realised means).

Arrivals. Poisson at `rate` requests/s (exponential gaps), as in the paper; `cv` != 1 draws
gamma gaps with shape 1/cv^2 (same mean 1/rate): cv > 1 is burstier than Poisson.

Prompts. For real models, prompts are real English text (a public-domain paragraph, repeated
and cut at the drawn token length); outputs use ignore_eos, so each request generates exactly
its drawn output length (needed for the Orca-oracle baseline and for fair comparisons).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.sampling_params import SamplingParams
from paged_jax.sizes import cdiv

# Opening of "A Tale of Two Cities" (Dickens, 1859; public domain).
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
    "was the season of Light, it was the season of Darkness, it was the spring of hope, it "
    "was the winter of despair, we had everything before us, we had nothing before us, we "
    "were all going direct to Heaven, we were all going direct the other way - in short, the "
    "period was so far like the present period, that some of its noisiest authorities "
    "insisted on its being received, for good or for evil, in the superlative degree of "
    "comparison only. "
)


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """Lognormal input/output token lengths with the paper's means.

    Attributes:
      name: dataset the distribution imitates.
      input_mean, output_mean: mean tokens (paper, Fig. 11).
      input_sigma, output_sigma: lognormal sigma (our choice, see the module docstring).
    """

    name: str
    input_mean: float
    output_mean: float
    input_sigma: float
    output_sigma: float


SHAREGPT = LengthDist("sharegpt", 161.31, 337.99, 1.0, 1.0)
ALPACA = LengthDist("alpaca", 19.31, 58.45, 0.7, 0.7)
DATASETS = {d.name: d for d in (SHAREGPT, ALPACA)}


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One request of a workload."""

    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    arrival: float  # seconds from the start of the run

    def params(self, **overrides) -> SamplingParams:
        """Greedy, exactly `output_len` tokens (ignore_eos), unless overridden."""
        kw = dict(temperature=0.0, max_tokens=self.output_len, ignore_eos=True)
        return SamplingParams(**{**kw, **overrides})


def lognormal(mean: float, sigma: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n lognormal draws with the given mean (not median) and log-space sigma."""
    mu = np.log(mean) - sigma**2 / 2
    return rng.lognormal(mu, sigma, n)


def sample_lengths(dist: LengthDist, n: int, rng: np.random.Generator, scale: float = 1.0,
                   max_model_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(input lengths, output lengths) of n requests, integers >= 1, clipped to fit."""
    inp = np.maximum(1, np.round(lognormal(dist.input_mean * scale, dist.input_sigma, n, rng)))
    out = np.maximum(1, np.round(lognormal(dist.output_mean * scale, dist.output_sigma, n, rng)))
    if max_model_len is not None:
        inp = np.minimum(inp, max_model_len // 2)
        out = np.minimum(out, max_model_len - inp)
    return inp.astype(int), out.astype(int)


def arrivals(n: int, rate: float, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    """Arrival times of n requests at `rate`/s: Poisson (cv=1) or gamma gaps; inf rate = 0."""
    if not np.isfinite(rate):
        return np.zeros(n)
    if cv == 1.0:
        gaps = rng.exponential(1.0 / rate, n)
    else:
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    return np.cumsum(gaps) - gaps[0]  # the first request arrives at t = 0


def text_prompt(n_tokens: int, tokenizer, text: str = TEXT) -> list[int]:
    """Exactly n_tokens token ids of real text: `text` repeated, cut at the length. Without a
    tokenizer the ids are the text's UTF-8 bytes (valid in any vocabulary of >= 256)."""
    ids = tokenizer.encode(text) if tokenizer is not None else list(text.encode())
    reps = cdiv(n_tokens, max(1, len(ids)))
    return (ids * reps)[:n_tokens]


def make_workload(dist: LengthDist | str, n: int, rate: float, tokenizer, seed: int = 0,
                  scale: float = 1.0, max_model_len: int | None = None,
                  cv: float = 1.0) -> list[WorkItem]:
    """A seeded workload of n requests: lengths from `dist`, arrivals at `rate`/s.

    Args:
      dist: a LengthDist or a name in DATASETS.
      n: number of requests.
      rate: requests per second (inf: all at t = 0).
      tokenizer: encodes the prompt text (the model's own tokenizer; None: UTF-8 bytes).
      seed: seeds lengths and arrivals.
      scale: length scale factor (1.0 = the paper's means).
      max_model_len: clip so that prompt + output fits.
      cv: coefficient of variation of the inter-arrival gaps (1 = Poisson).
    """
    dist = DATASETS[dist] if isinstance(dist, str) else dist
    rng = np.random.default_rng(seed)
    inp, out = sample_lengths(dist, n, rng, scale, max_model_len)
    times = arrivals(n, rate, rng, cv)
    base = text_prompt(int(inp.max()), tokenizer)
    return [WorkItem(f"{dist.name}-{i}", base[: int(a)], int(b), float(t))
            for i, (a, b, t) in enumerate(zip(inp, out, times, strict=True))]


def describe(items: list[WorkItem]) -> dict:
    """Realised means of a workload (after clipping), for result files."""
    inp = [len(w.prompt_token_ids) for w in items]
    out = [w.output_len for w in items]
    span = items[-1].arrival - items[0].arrival if len(items) > 1 else 0.0
    return dict(n=len(items), mean_input=float(np.mean(inp)), mean_output=float(np.mean(out)),
                max_input=int(max(inp)), max_output=int(max(out)), span_s=float(span))
