"""The engine's structured outputs at submission: each request's constraint compiled (cached
per distinct constraint) and a matcher at its start for each of its sequences.

The compiler's tokenizer table takes about a second to build for a 150k-token vocabulary
(llguidance walks every token), so it is built once per tokenizer, in the background from
the engine's start: the first constrained request does not wait for it in its TTFT.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

from paged_jax.engine.sequence import Request
from paged_jax.sample import grammar

if TYPE_CHECKING:
    from paged_jax.models.tokenizer import Tokenizer

_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> {V: Grammars}
_LOCK = threading.Lock()


def grammars_for(tokenizer: Tokenizer, vocab_size: int) -> grammar.Grammars:
    """The one Grammars of a tokenizer and vocabulary size (built on the first call)."""
    with _LOCK:
        per = _SHARED.setdefault(tokenizer, {})
        if vocab_size not in per:
            per[vocab_size] = grammar.Grammars(tokenizer.backend.to_str(), vocab_size,
                                               tokenizer.eos_token_ids)
        return per[vocab_size]


class Constraints:
    """Compiles requests' constraints for one engine (its tokenizer may be None: then a
    constrained request is refused)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ready: threading.Thread | None = None
        self._failed: Exception | None = None
        if tokenizer is not None:
            self._ready = threading.Thread(target=self._build, daemon=True,
                                           name="paged-jax-grammars")
            self._ready.start()

    def _build(self) -> None:
        try:
            grammars_for(self.tokenizer, self.vocab_size)
        except Exception as e:  # noqa: BLE001 (reported to the first constrained request)
            self._failed = e

    def attach(self, req: Request) -> None:
        """Compiles `req`'s constraint and gives each of its sequences a matcher.

        Raises:
          ValueError: the constraint is invalid (naming it), or there is no tokenizer.
        """
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer, and this engine has none "
                             "(skip_tokenizer_init)")
        self._ready.join()
        if self._failed is not None:
            raise ValueError(f"structured_outputs is unavailable: {self._failed!r} (it needs "
                             f"the llguidance package)") from self._failed
        grammars = grammars_for(self.tokenizer, self.vocab_size)
        compiled = grammars.compile(req.params.structured_outputs)
        for seq in req.seqs:
            seq.matcher = grammars.matcher(compiled)
