"""Speculative decoding, host side: the config (vLLM's `speculative_config`), the n-gram
(prompt lookup) proposer, and the plan of a draft model's catch-up (engine/draft.py makes
its drafts on the device, inside the verify call).

    schedule()  a decode-only plan: each eligible sequence gets up to k draft tokens, the
                continuation of the latest earlier occurrence of its longest suffix n-gram
                (prompt_lookup_max .. prompt_lookup_min tokens); its chunk becomes 1 + k
    run_verify  engine/verify.py: the k + 1 tokens through the same ragged forward, each
                position sampled as plain decoding would sample it, the longest agreeing
                prefix kept, the rest rolled back (a shorter sequence in the page table)

A row verifies by sampling every position with the key plain decoding would use there
(fold_in(key, num_generated + j)) and keeping drafts while they equal those samples. Each
emitted token is therefore exactly the token non-speculative decoding emits: greedy and seeded
output are identical, and for a one-hot (n-gram) proposal the acceptance probability is the
target's p(draft), the same as Leviathan et al.'s rejection sampling.

Who speculates: sequences decoding one token, on a live slot, without penalties (their
[V] counts would change inside the run), while the batch has fewer than
`disable_by_batch_size` sequences; the rest decode as before in the same step.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from paged_jax.engine.kv_manager import KVManager
    from paged_jax.engine.plan import Plan
    from paged_jax.engine.sequence import Request, Sequence
    from paged_jax.models import ModelConfig

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config keys that apply here.

    Attributes:
      method: "ngram" (prompt lookup) or "draft_model" (a smaller model over the same
        vocabulary drafts: `model`).
      model: the draft model (a path or short name, as LLM takes), "draft_model" only.
      quantization: the draft's weights, None (as the engine's) or "int8" / "int4" (the
        CPU matmul kernel's weight-only formats): a draft step reads fewer bytes, and its
        drafts only decide how much is kept, never what is emitted.
      num_speculative_tokens: k, the most draft tokens a sequence verifies per step.
      prompt_lookup_min / prompt_lookup_max: n-gram lengths searched, longest first.
      disable_by_batch_size: speculate only while fewer sequences than this decode (vLLM's
        name); larger batches are bound by compute, where verifying rejected tokens costs.
      draft_stop_probability: a draft model only: a row stops drafting once the draft's
        probability of its drafts so far (their product) falls below this, so a verify
        step may check fewer than k (0: always k). Each draft step is a draft forward; one
        after an unlikely draft is mostly wasted. The output is unchanged (greedy: plain
        decoding's; sampled: the rejection rule holds for any number of drafts).
    """

    method: str = "ngram"
    model: str | None = None
    quantization: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 1 << 30
    draft_stop_probability: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got "
                             f"{self.method!r}")
        if (self.model is None) != (self.method == "ngram"):
            raise ValueError("speculative_config: method 'draft_model' takes a draft `model`; "
                             f"'ngram' takes none (got method {self.method!r}, model "
                             f"{self.model!r})")
        if self.quantization not in (None, "int8", "int4") or (
                self.quantization and self.model is None):
            raise ValueError(f"speculative_config quantization must be None, 'int8' or 'int4' "
                             f"and applies to a draft model, got {self.quantization!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in 1..16, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")
        if not 0.0 <= self.draft_stop_probability < 1.0 or (
                self.draft_stop_probability and self.model is None):
            raise ValueError(f"draft_stop_probability must be in [0, 1) and applies to a draft "
                             f"model, got {self.draft_stop_probability!r}")

    @classmethod
    def of(cls, spec: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From vLLM's dict form (unknown keys named in the error); a `model` without a
        method means "draft_model", as in vLLM."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        spec = dict(spec)
        if "method" not in spec:
            spec["method"] = "ngram" if spec.get("model") is None else "draft_model"
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(spec) - known):
            raise ValueError(f"speculative_config: unknown keys {unknown}; known {sorted(known)}")
        return cls(**spec)

    def applies(self, batch: int) -> bool:
        """Whether a batch of this many decoding sequences speculates."""
        return batch < self.disable_by_batch_size

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def draft_model(self) -> bool:
        return self.method == "draft_model"


def check_draft(ec, model: ModelConfig, draft: tuple[ModelConfig, object] | None) -> None:
    """A draft model is given exactly when the config asks for one, over the same
    vocabulary, on one device (ValueError naming what is wrong)."""
    spec = ec.speculative
    wants = spec is not None and spec.draft_model
    if wants and draft is None:
        raise ValueError(f"speculative_config names draft model {spec.model!r}; pass its "
                         "(config, params) as `draft` (LLM loads it)")
    if draft is None:
        return
    if not wants:
        raise ValueError("a draft model was given but speculative_config method is not "
                         "'draft_model'")
    if draft[0].vocab_size != model.vocab_size:
        raise ValueError(f"draft model vocabulary ({draft[0].vocab_size} tokens) differs from "
                         f"the model's ({model.vocab_size}): drafts must be the same tokens")
    if ec.tensor_parallel_size > 1:
        raise ValueError("a draft model runs on one device: tensor_parallel_size must be 1")


def ngram_propose(tokens: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of n_max .. n_min tokens (prompt lookup); [] when no suffix recurs."""
    toks = np.asarray(tokens, dtype=np.int64)
    size = toks.shape[0]
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # windows starting at i < size - n: each is followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(toks[:-1], n)
        hits = np.flatnonzero((windows == toks[size - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return toks[start:start + k].tolist()
    return []


def add_drafts(plan: Plan, spec: SpeculativeConfig, kv: KVManager, budget: int,
               free: int, catch_up: int) -> None:
    """Drafts for a decode-only plan that admits nothing (Scheduler.schedule): each sequence
    that may speculate verifies up to k drafts, within the token `budget`, the `free` blocks
    left and its max_tokens (its last emitted token is always the target's own). With a
    draft model the drafts are placeholders its device loop fills in, and a row first has
    the draft read what it has not seen (Sequence.draft_computed on; at most `catch_up`
    tokens over the plan): a row that cannot catch up all the way drafts nothing yet. A row
    with structured outputs keeps the n-gram drafts its constraint allows (the verify step
    masks each of its positions: engine/batch.py) and drafts nothing with a draft model,
    whose drafts are made on the device, where no mask follows them."""
    if (not plan.decode_only or plan.admitted or plan.deferred
            or not spec.applies(len(plan.chunks))
            or not all(kv.slot_live[s.slot] for s, _ in plan.chunks)
            # an n > 1 prompt's last token forks its children: a plain step does that,
            # a verify call does not (its children's rows would be written, not forked)
            or any(s.owner.params.n > 1 and not s.owner.forked for s, _ in plan.chunks)
            # a beam's next tokens are the host's choice (engine/beam_search.py)
            or any(s.owner.beam is not None for s, _ in plan.chunks)):
        return
    for i, (seq, _) in enumerate(plan.chunks):
        room = min(spec.k, budget, seq.owner.params.max_tokens - len(seq.output_ids) - 1)
        if room <= 0 or not may_speculate(seq) or (seq.matcher and spec.draft_model):
            continue
        if spec.draft_model:
            lag = len(seq.tokens) - seq.draft_computed
            n = min(lag, catch_up)
            if n <= 0:
                continue
            plan.catchup[id(seq)], catch_up = (seq.draft_computed, n), catch_up - n
            drafts = [0] * room if n == lag else []
        else:
            drafts = ngram_propose(seq.tokens, room, spec.prompt_lookup_min,
                                   spec.prompt_lookup_max)
            if seq.matcher is not None:
                drafts = drafts[:seq.matcher.allows(drafts)]
        extra = kv.blocks_needed(seq, 1 + len(drafts)) - kv.blocks_needed(seq, 1)
        if not drafts or extra > free:
            continue
        free, budget = free - extra, budget - len(drafts)
        plan.chunks[i] = (seq, 1 + len(drafts))
        plan.drafts[id(seq)] = drafts


def may_speculate(seq: Sequence) -> bool:
    """Whether a decoding sequence may verify drafts: it has output (its prompt is done:
    no prompt logprobs, hidden state or fork pending), one token pending, and no penalties
    (their counts would change inside the run)."""
    p = seq.owner.params
    return bool(seq.output_ids) and seq.num_pending == 1 and not seq.num_placeholders and (
        p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0)


@dataclasses.dataclass
class SpecCounts:
    """Speculative decoding totals (vLLM's spec_decode metric names): verify rows with
    drafts, draft tokens proposed, draft tokens accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def count(self, req: Request, drafts: int, accepted: int) -> None:
        """One row's verify result, into these totals and its request's metrics."""
        for c in (self, req.metrics):
            c.num_drafts += 1
            c.num_draft_tokens += drafts
            c.num_accepted_tokens += accepted
