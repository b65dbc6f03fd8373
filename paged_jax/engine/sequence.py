"""Host-side bookkeeping of requests and their sequences (no device arrays here).

Each fact on a sequence has one writer: its tokens, text, logprobs, finish reason and
constraint matcher the output processing (engine/output.py); its status the scheduler; its
KV facts (slot, num_computed, draft_computed, maybe_shared_last, swapped, prefix_hit,
block_hashes) the KV manager.

A request owns n sequences (parallel sampling). Each sequence holds its tokens
(prompt + generated) and how many of them already have K/V in the cache:

    tokens:        [ p0 p1 p2 ... p(m-1) | o0 o1 ... o(k-1) ] (+ num_placeholders not read yet)
    num_computed:  ---------------------------^               K/V cached for tokens[:num_computed]
    the next step feeds tokens[num_computed : num_computed + chunk]; it samples a new token
    when that chunk reaches the end of `tokens` (prefill done, or a decode).
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from paged_jax.outputs import CompletionOutput, Logprob, RequestMetrics
from paged_jax.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (recompute) / swapped out
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)  # identity: `seq in list` must not compare token lists
class Sequence:
    """One output stream of a request, living in page-table slot `slot` while admitted."""

    index: int
    tokens: list[int]
    prompt_len: int
    slot: int = -1
    num_computed: int = 0
    # Speculative decoding with a draft model: its K/V hold tokens[:draft_computed] (written
    # by the KV manager, like num_computed; it follows num_computed through ragged steps).
    draft_computed: int = 0
    status: Status = Status.WAITING
    # True while the partly filled last block may be shared with a fork (copy-on-write).
    maybe_shared_last: bool = False
    # Tokens sampled on the device whose step the host has not read yet (async scheduling:
    # the next step was planned before this one's output came back). Written by the scheduler.
    num_placeholders: int = 0
    swapped: object = None  # host copy of its K/V blocks while swapped out
    # Prefix caching: hashes of the full blocks of `tokens` (a chain, grown lazily), and the
    # cache hit chosen at admission, attached on the device when the slot goes live.
    block_hashes: list[int] = dataclasses.field(default_factory=list)
    prefix_hit: object = None
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""
    committed_text: str = ""  # detokenized text of output_ids[:read_offset]
    read_offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Structured outputs: where its tokens are in the request's constraint (sample/grammar.py
    # Matcher), made at submission, advanced only by the output processing with its tokens.
    matcher: object = None
    # Beam search (engine/beam_search.py): a slot held for a beam's fork to come; it holds no
    # K/V and computes nothing (not among its request's live_seqs).
    spare: bool = False
    owner: Request | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def length(self) -> int:
        """Tokens including those sampled on the device and not read yet."""
        return len(self.tokens) + self.num_placeholders

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V the next steps must compute."""
        return self.length - self.num_computed

    def copies_on_write(self, n: int, block_size: int) -> bool:
        """Whether writing `n` more tokens may copy its last block first: it is partly filled
        and may be shared (a fork, or a prefix hit that ends inside it)."""
        return bool(self.maybe_shared_last and self.num_computed % block_size and n > 0)

    def at_max_tokens(self) -> bool:
        """Its output (placeholders counted) is as long as max_tokens allows."""
        most = self.owner.params.max_tokens
        return most is not None and self.length - self.prompt_len >= most

    @property
    def hash_salt(self) -> tuple | None:
        """What its prefix-cache hash chain starts from: its adapter's id (a hit never
        crosses adapters: the same tokens hold other K/V under another adapter)."""
        lora = self.owner.lora if self.owner is not None else None
        return None if lora is None else ("lora", lora.lora_int_id)

    def wants_hidden(self, n: int) -> bool:
        """Whether computing its next n tokens ends its request's first prefill and the
        request asked for the prompt's hidden state (a recompute after preemption does not
        ask again; a decode window cannot return it)."""
        return (self.owner.params.return_hidden_states and self.owner.hidden_states is None
                and self.num_computed + n == len(self.tokens) == self.prompt_len)

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(self.output_ids),
            cumulative_logprob=(None if self.owner is None or self.owner.params.logprobs is None
                                else self.cumulative_logprob),  # as vLLM: only when asked
            logprobs=self.logprobs or None, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclasses.dataclass(eq=False)  # identity, as for Sequence
class Request:
    """A submitted request: its prompt, parameters, sequences and timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    order: int  # admission counter: larger = admitted later (preempted first)
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    metrics: RequestMetrics | None = None  # None: from arrival_time (__post_init__)
    forked: bool = False  # children of an n > 1 request exist on the device
    num_cached_tokens: int = 0
    banned_ids: tuple[int, ...] = ()  # token ids of its bad words (engine_input)
    # vLLM's prompt_logprobs: None first, then one entry per prompt token (filled as computed)
    prompt_logprobs: list | None = None
    hidden_states: np.ndarray | None = None  # SamplingParams.return_hidden_states
    num_preemptions: int = 0  # times preempted (vLLM's num_preemptions)
    lora: object = None  # its LoRARequest (paged_jax/lora), None: the base model
    beam: object = None  # a beam search's BeamRun (engine/beam_search.py); None: sampled

    @property
    def device_settles(self) -> bool:
        """Whether the device settles its rows after a call (stops, cached blocks): every
        request's but a beam search's, whose next tokens and ends the host picks."""
        return self.beam is None

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.seqs)

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status is not Status.FINISHED and not s.spare]

    def held_seqs(self) -> list[Sequence]:
        """Its sequences that hold a slot or may get one (live ones and beam spares)."""
        return [s for s in self.seqs if s.status is not Status.FINISHED]
