"""The benchmarks' prompts: real questions through the model's chat template (or plain-text
story openings for a base model without one), as token ids every side receives unchanged."""

from __future__ import annotations

from paged_jax.precision import PASSAGE  # noqa: F401  (one writer: the library's check)

TOPICS = ("the ocean", "bread", "the moon", "trains", "music", "gardens", "rain", "chess",
          "bees", "libraries", "mountains", "coffee", "rivers", "bicycles", "stars", "winter")

SYSTEM = ("You are a careful assistant for a public library. Answer in plain words, cite the "
          "shelf a reader should visit, keep answers short, never invent a book title, and "
          "when a question is unclear, say what you would need to know to answer it. ") * 2


def chat_ids(tok, n: int, system: str | None = None) -> list[list[int]]:
    """n single-turn chat prompts (after a shared `system` message if given)."""
    head = [{"role": "system", "content": system}] if system else []
    return [tok.encode(tok.apply_chat_template(
        head + [{"role": "user", "content": f"Write a short story about "
                                            f"{TOPICS[i % len(TOPICS)]} (number {i})."}],
        add_generation_prompt=True)) for i in range(n)]


def text_ids(tok, n: int, system: str | None = None) -> list[list[int]]:
    """n plain-text story openings (for a base model without a chat template)."""
    head = system or ""
    return [tok.encode(f"{head}Here is a short story about {TOPICS[i % len(TOPICS)]} "
                       f"(number {i}).\n\n") for i in range(n)]


def prompt_ids(tok, n: int, system: str | None = None) -> list[list[int]]:
    """The workload's prompts: chat prompts, or plain text for a model without a template."""
    return (chat_ids if tok.chat_template else text_ids)(tok, n, system)
