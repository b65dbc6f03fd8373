"""Request outputs with vLLM's class and field names, so offline-API callers read them unchanged.

    RequestOutput(request_id, prompt, prompt_token_ids, outputs=[CompletionOutput, ...], ...)
    CompletionOutput(index, text, token_ids, cumulative_logprob, logprobs, finish_reason, ...)
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Logprob:
    """Log-probability of one token (vLLM's `Logprob`).

    Attributes:
      logprob: log-probability under the model's raw distribution.
      rank: 1-based rank of the token in that distribution (1 = most likely).
      decoded_token: the token's text, when detokenized.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated position: token id -> Logprob for the sampled token and the top-k tokens."""


@dataclasses.dataclass
class CompletionOutput:
    """One output sequence of a request (vLLM's `CompletionOutput`).

    Attributes:
      index: which of the request's n outputs this is.
      text: generated text.
      token_ids: generated token ids.
      cumulative_logprob: sum of the sampled tokens' logprobs; None when not computed.
      logprobs: per-position top logprobs, when `SamplingParams.logprobs` was set.
      finish_reason: None while running, else "stop" (EOS, stop token or string) or "length".
      stop_reason: the stop token id or stop string that ended it; None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Whether this output has stopped."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps of a request's life, in `time.time()` seconds (vLLM's `RequestMetrics`).

    Attributes:
      arrival_time: when the request was added.
      first_scheduled_time: when it was first scheduled.
      first_token_time: when its first output token was sampled.
      last_token_time: when its latest output token was sampled.
      finished_time: when it finished.
      time_in_queue: first_scheduled_time - arrival_time.
      num_drafts, num_draft_tokens, num_accepted_tokens: speculative decoding: verify steps
        with drafts, draft tokens proposed, and accepted (vLLM's spec_decode names).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclasses.dataclass
class RequestOutput:
    """Everything returned for one request (vLLM's `RequestOutput`).

    Attributes:
      request_id: the request's id.
      prompt: the prompt text (None when given as token ids).
      prompt_token_ids: the prompt's token ids.
      outputs: the n completions, in index order.
      finished: whether every output has finished.
      metrics: timing of the request.
      num_cached_tokens: prompt tokens served from the prefix cache.
      prompt_logprobs: with SamplingParams.prompt_logprobs, one entry per prompt token (None
        for the first): its logprob and rank, plus the top alternatives.
      model: which model served it, when a router chose (paged_jax.routing); else None.
      hidden_states: with SamplingParams.return_hidden_states, the prompt's last-token hidden
        state (numpy [hidden_size] fp32), once its prefill is done; else None.
      num_preemptions: times the request was preempted (its blocks freed, then recomputed or
        swapped back in); vLLM reports it per request too.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    model: str | None = None
    hidden_states: np.ndarray | None = None
    num_preemptions: int = 0


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: its tokens, their logprobs, and its text (vLLM's `BeamSearchSequence`).

    Attributes:
      tokens: prompt + generated token ids.
      logprobs: per generated position, token id -> Logprob.
      cum_logprob: sum of the generated tokens' logprobs.
      text: decoded text, once finished.
      finish_reason: "stop" or "length", once finished.
      stop_reason: the stop token id or string, if one ended it.
    """

    tokens: list[int]
    logprobs: SampleLogprobs = dataclasses.field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """Result of beam search for one prompt: the best `beam_width` beams, best first."""

    sequences: list[BeamSearchSequence]
