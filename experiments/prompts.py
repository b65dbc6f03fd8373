"""The benchmarks' prompts: real questions through the model's chat template (or plain-text
story openings for a base model without one), as token ids every side receives unchanged."""

from __future__ import annotations

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


PASSAGE = (
    "The harbour town woke slowly in winter. Before the sun rose over the grey water, the "
    "bakers had already lit their ovens, and the smell of warm bread drifted along the narrow "
    "streets toward the quay. Fishing boats came back one by one, their decks crowded with "
    "nets, crates and tired men who talked little and laughed often. On the hill above the "
    "market stood an old library, built of pale stone two centuries ago, where a single "
    "librarian kept the lamps burning and the catalogue in order.\n\n"
    "Most mornings the first visitor was a retired schoolteacher who read newspapers from "
    "distant cities and wrote long letters to friends she had not seen in years. She liked "
    "the quiet of the reading room, the creak of the wooden floor and the way the light fell "
    "across the tables when the clouds broke. The librarian knew which chair she preferred "
    "and which papers she would ask for, and had them ready before she arrived.\n\n"
    "In the afternoon the children came from school. They wanted stories about ships, storms "
    "and islands that did not appear on any map. The librarian read aloud to them in a low "
    "voice, pausing at the best moments so that they leaned closer and begged her to go on. "
    "Some of them later borrowed the same books again and again, until the pages were soft "
    "and the spines had to be mended with tape and thread.\n\n"
    "When spring returned, the town changed its rhythm. Tourists arrived on the morning "
    "train, the cafes set out chairs along the water, and the market filled with flowers, "
    "cheese and early vegetables from the farms inland. The library grew busier too: "
    "students prepared for their examinations, travellers looked for maps of the coast, and "
    "a few writers rented the small room upstairs to finish the books they had promised to "
    "their publishers long ago. Through all of it the librarian kept the same calm routine, "
    "opening the doors at nine, closing them at six, and writing in a thick notebook every "
    "evening what the town had read that day."
)
"""A fixed English passage (written for this project) whose perplexity the quantization
experiments measure: about 400 tokens, so it fits bench.py's 512-token context."""
