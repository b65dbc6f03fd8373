"""Structured outputs: a request's constraint compiled once, a matcher per sequence, and the
token mask the sampler applies (llguidance: Earley parsing over the tokenizer's trie).

    submission   Grammars.compile(StructuredOutputsParams) -> grammar text (checked, cached)
                 Grammars.matcher(grammar) -> Matcher, one per sequence
    each step    fill_masks(rows) -> [R, W] int32, bit t % 32 of word t // 32 set when token
                 t may come next (host, the rows that sample under a constraint, and in a
                 verify step each of their drafts' positions; others all ones), sent with
                 the step; `apply_mask` inside the jitted sampler under the static flag
                 SampleFlags.grammar
    its output   Matcher.accept(tokens) (engine/output.py), which also finds the constraint
                 complete (the request stops) or broken

llguidance is imported on first use: engines without constrained requests never load it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from paged_jax.sampling_params import StructuredOutputsParams
from paged_jax.types import Array, Float, HostArray, Int

CACHE_SIZE = 128
"""Distinct constraints kept compiled per engine (least recently used dropped first)."""


@dataclasses.dataclass
class Stats:
    """Host time spent on constraints, process-wide (experiments read it)."""

    compiles: int = 0
    compile_seconds: float = 0.0
    masks: int = 0  # rows masked
    mask_seconds: float = 0.0


STATS = Stats()


class Matcher:
    """One sequence's position in its constraint (an llguidance LLMatcher)."""

    def __init__(self, ll) -> None:
        self.ll = ll

    def accept(self, tokens: Sequence[int]) -> bool:
        """Advances over sampled tokens; False when one breaks the constraint."""
        return all(self.ll.consume_token(int(t)) for t in tokens)

    def allows(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (drafts) the constraint allows in a row, without consuming."""
        return self.ll.validate_tokens([int(t) for t in tokens])

    @property
    def complete(self) -> bool:
        """The constraint is satisfied and allows no more tokens (EOS aside)."""
        return self.ll.is_stopped() and not self.ll.is_error()

    @property
    def error(self) -> str:
        """Why the constraint broke ("" while it holds)."""
        return self.ll.get_error() if self.ll.is_error() else ""


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary, and makes their matchers.

    Args:
      tokenizer_json: the `tokenizers` tokenizer serialised (`Tokenizer.to_str()`).
      vocab_size: V, the model's vocabulary (ids past the tokenizer's are never allowed).
      eos_ids: the model's EOS ids: allowed once a constraint is complete.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        import llguidance

        self._ll = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_ids) or None)
        self._cache: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The checked grammar of `spec`, compiled once per distinct constraint.

        Raises:
          ValueError: naming the constraint and what is wrong with it.
        """
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        t0 = time.perf_counter()
        grammar = self._grammar(spec)
        error = self._ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {error.strip()}")
        STATS.compiles += 1
        STATS.compile_seconds += time.perf_counter() - t0
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _grammar(self, spec: StructuredOutputsParams) -> str:
        ll = self._ll
        if spec.kind in ("json", "json_object"):
            options = {"whitespace_flexible": not spec.disable_any_whitespace}
            if spec.whitespace_pattern is not None:
                options["whitespace_pattern"] = spec.whitespace_pattern
            schema = spec.json if spec.kind == "json" else {"type": "object"}
            try:
                return ll.LLMatcher.grammar_from_json_schema(schema, overrides=options)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is invalid: {e}") from None
        if spec.kind == "grammar":
            fmt = "lark" if _looks_lark(spec.grammar) else "grammar"  # else GBNF -> Lark
            try:
                return ll.grammar_from(fmt, spec.grammar)
            except ValueError as e:
                raise ValueError(f"structured_outputs.grammar is invalid: {e}") from None
        return ll.grammar_from(spec.kind, spec.regex if spec.kind == "regex" else spec.choice)

    def matcher(self, grammar: str) -> Matcher:
        """A fresh matcher at the start of `grammar` (from `compile`)."""
        return Matcher(self._ll.LLMatcher(self.tokenizer, grammar, log_level=0))


def _looks_lark(text: str) -> bool:
    """GBNF defines rules with `::=`, Lark with `:`."""
    return "::=" not in text


_EXECUTOR = None


def fill_masks(rows: list[tuple[Matcher, int, list[int]]], num_rows: int, vocab_size: int,
               eos_ids: Sequence[int]) -> Int[HostArray, "R W"]:
    """[R, W] allowed-token bitmasks. For each (matcher, row, drafts): row `row` gets the
    matcher's next tokens, and rows row + 1 .. row + len(drafts) the next tokens after each
    draft (a verify step's positions; the matcher is left where it was). All ones for the
    other rows. A row whose constraint allows nothing (it broke) may only end: its EOS ids
    are allowed, and the output processing stops it with the matcher's error."""
    global _EXECUTOR
    import llguidance
    import llguidance.numpy as llnp

    t0 = time.perf_counter()
    masks = np.full((num_rows, (vocab_size + 31) // 32), -1, np.int32)
    if rows:
        _EXECUTOR = _EXECUTOR or llguidance.LLExecutor()
        plain = [(m.ll, r) for m, r, d in rows if not d]
        drafted = [(m.ll, r, [int(t) for t in d]) for m, r, d in rows if d]
        if plain:  # llguidance's draft variant refuses an empty draft list
            llnp.fill_next_token_bitmask_par(_EXECUTOR, plain, masks)
        if drafted:
            llnp.fill_next_token_bitmask_par_with_draft_tokens(_EXECUTOR, drafted, masks)
        words = masks.view(np.uint32)
        for r in (r + i for _, r, d in rows for i in range(len(d) + 1)):
            if not words[r].any():
                for t in eos_ids:
                    words[r, t // 32] |= np.uint32(1 << (t % 32))
    STATS.masks += sum(len(d) + 1 for _, _, d in rows)
    STATS.mask_seconds += time.perf_counter() - t0
    return masks


def apply_mask(logits: Float[Array, "S V"], masks: Int[Array, "S W"]) -> Float[Array, "S V"]:
    """Logits of tokens a row's mask does not allow set to -inf (jittable)."""
    v = logits.shape[1]
    bits = (masks[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(masks.shape[0], -1)[:, :v].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)
