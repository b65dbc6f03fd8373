"""An evaluation set made by code: few-shot completion prompts whose answers can be checked.

Each family has a difficulty knob (digits, word length, table size), so a small model gets the
easy items right and the hard ones wrong, and a stronger one gets further. Both models are
asked the same prompt (a base model and an instruct model both continue "Q: ... A:" text),
and the answer is the completion up to its first newline, compared after stripping spaces.

    family    question                                    difficulty d
    add       "What is 482 + 377?"                        digits of the operands (1..3)
    mul       "What is 23 * 7?"                           digits of the operands (1..2)
    compare   "Which is larger, 5012 or 5102?"            digits (1..6)
    count     "How many times does 'a' occur in ...?"     letters of the string (4..10)
    reverse   "Reverse the letters 'kfe'."                letters (2..4)
    last      "Last letters of 'red sun cap'?"            words (2..3)
    lookup    "In the table ..., what does X cost?"       rows of the table shipped in
                                                          routing/data/items.csv (2..12)
    capital   "What is the capital of Peru?"              how well known the country is
                                                          (tiers 1..5, routing/data/capitals.csv)
    opposite  "What is the opposite of 'brave'?"          tiers 1..3 (data/opposites.csv)
    after     "Which letter comes 2 after 'k'?"           the step (1..4)
    define    "What is a fjord?"                          how common the word is (tiers
                                                          1..3, routing/data/definitions.csv)

The first seven are worked out in the prompt (the model must compute); the rest test what a
model knows, where a bigger model is expected to do better. "define" is open: many answers
are right, so it is not checked by string; its label is the likelihood each model gives the
reference answer (routing/likelihood.py), and `Item.open` says so.

`make_items(n, seed)` draws a fixed, seeded set; the same seed gives the same items.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import random
import string
from collections.abc import Callable
from pathlib import Path

from paged_jax.routing import code_tasks

TABLE = Path(__file__).parent / "data" / "items.csv"
SHOTS = 3  # worked examples before the question
WORDS = ("apple", "river", "planet", "garden", "silver", "window", "candle", "forest", "bridge",
         "orange", "pencil", "rocket", "marble", "thunder", "harvest", "lantern", "meadow",
         "cat", "sun", "red", "cap", "dog", "sky", "ink", "owl", "jam", "map", "box", "tea")


@dataclasses.dataclass(frozen=True)
class Item:
    """One question: its family, difficulty, the prompt both models complete, the answer."""

    family: str
    difficulty: int
    prompt: str
    answer: str

    @property
    def open(self) -> bool:
        """Scored by the likelihood of the reference answer, not by checking a completion."""
        return self.family in OPEN_FAMILIES

    def correct(self, completion: str) -> bool:
        """Whether a completion answers it: its first line, stripped, equals the answer (code
        questions: routing/code_tasks.py checks them with Python)."""
        if self.family in CODE_FAMILIES:
            return code_tasks.check(self.family, self.answer, completion)
        first = completion.strip().split("\n", 1)[0].strip().rstrip(".")
        return first == self.answer.rstrip(".")


def _num(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def _add(rng, d):
    a, b = _num(rng, d), _num(rng, d)
    return f"What is {a} + {b}?", str(a + b)


def _mul(rng, d):
    a, b = _num(rng, d), _num(rng, max(1, d - rng.randint(0, 1)))
    return f"What is {a} * {b}?", str(a * b)


def _compare(rng, d):
    a = _num(rng, d)
    digits = list(str(a))
    i, j = rng.sample(range(len(digits)), 2) if len(digits) > 1 else (0, 0)
    digits[i], digits[j] = digits[j], digits[i]  # same digits, so size alone does not tell
    b = int("".join(digits))
    if a == b:
        b = a + rng.randint(1, 9)
    return f"Which is larger, {a} or {b}?", str(max(a, b))


def _count(rng, d):
    letters = "ab" if d < 8 else "abc"
    s = "".join(rng.choice(letters) for _ in range(d))
    return f"How many times does 'a' occur in '{s}'?", str(s.count("a"))


def _reverse(rng, d):
    w = "".join(rng.choice("abcdefghiklmnoprstu") for _ in range(d))  # no word to recall
    return f"Reverse the letters '{w}'.", w[::-1]


def _last(rng, d):
    ws = rng.sample(WORDS, d)
    return f"Last letters of '{' '.join(ws)}'?", "".join(w[-1] for w in ws)


def _lookup(rng, d):
    rows = rng.sample(table(), d)
    name, price = rng.choice(rows)
    listing = "; ".join(f"{n} costs {p}" for n, p in rows)
    return f"In the table [{listing}], what does {name} cost?", price


def _capital(rng, d):
    country, city = rng.choice([(r["country"], r["capital"]) for r in rows("capitals")
                                if int(r["tier"]) == d])
    return f"What is the capital of {country}?", city


def _opposite(rng, d):
    word, opp = rng.choice([(r["word"], r["opposite"]) for r in rows("opposites")
                            if int(r["tier"]) == d])
    return f"What is the opposite of '{word}'?", opp


def _after(rng, d):
    i = rng.randrange(26 - d)
    return (f"Which letter comes {d} after '{string.ascii_lowercase[i]}'?",
            string.ascii_lowercase[i + d])


def _define(rng, d):
    word, meaning = rng.choice([(r["word"], r["definition"]) for r in rows("definitions")
                                if int(r["tier"]) == d])
    article = "an" if word[0] in "aeiou" else "a"
    return f"What is {article} {word}?", f"{article.capitalize()} {word} is {meaning}."


@functools.cache
def rows(name: str) -> tuple[dict, ...]:
    """The rows of a table shipped as test data (routing/data/<name>.csv)."""
    with (TABLE.parent / f"{name}.csv").open() as f:
        return tuple(csv.DictReader(f))


def table() -> list[tuple[str, str]]:
    """The lookup table shipped as test data: (item, price) rows."""
    return [(r["item"], r["price"]) for r in rows("items")]


FAMILIES: dict[str, tuple[Callable, range]] = {
    "add": (_add, range(1, 4)), "mul": (_mul, range(1, 3)), "compare": (_compare, range(1, 7)),
    "count": (_count, range(4, 11, 2)), "reverse": (_reverse, range(2, 5)),
    "last": (_last, range(2, 4)), "lookup": (_lookup, range(2, 13, 2)),
    "capital": (_capital, range(1, 6)), "opposite": (_opposite, range(1, 4)),
    "after": (_after, range(1, 5)), "define": (_define, range(1, 4)),
}
OPEN_FAMILIES = ("define",)
CODE_FAMILIES = code_tasks.CODE_FAMILIES
ALL_FAMILIES = {**FAMILIES, **CODE_FAMILIES}
"""Every family make_items can draw: FAMILIES (the default set, the shipped head's) and the
code questions (routing/code_tasks.py), asked by name."""


def make_item(family: str, difficulty: int, rng: random.Random) -> Item:
    """One item of a family: SHOTS solved examples of the same family and difficulty, then
    the question, as "Q: ...\\nA: ..." lines."""
    make = ALL_FAMILIES[family][0]
    shots = [make(rng, difficulty) for _ in range(SHOTS)]
    for _ in range(100):  # a question its own examples do not already answer
        question, answer = make(rng, difficulty)
        if all(question != q for q, _ in shots):
            break
    text = "".join(f"Q: {q}\nA: {code_tasks.shot_answer(family, a)}\n" for q, a in shots)
    text += f"Q: {question}\nA:"
    return Item(family, difficulty, text, answer)


def make_items(n: int, seed: int = 0, families: tuple[str, ...] | None = None) -> list[Item]:
    """n items, spread evenly over the families and their difficulties, seeded."""
    rng = random.Random(seed)
    names = list(families or FAMILIES)
    grid = [(f, d) for f in names for d in ALL_FAMILIES[f][1]]
    return [make_item(*grid[i % len(grid)], rng) for i in range(n)]
