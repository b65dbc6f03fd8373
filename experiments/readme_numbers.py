"""How a number the README quotes is traced to its results files (tests/test_readme.py).

A number is read whole, with its unit: "2.61x" is a ratio of 2.61 (never "2"), "82%" a
percentage, "9 / 16" a pair. Each must match a stored value *at the precision shown*: the
stored value rounds to the digits written (|v - shown| <= half a unit of the last digit),
nothing looser.

    plain    "253", "0.736", "-0.5"   a value of the files (the sign included), or the length
                                      of a stored list (a count)
    percent  "82%", "79.917%"         a value v with 100 v or v rounding to it
    ratio    "2.61x"                  a stored value: a quotient the README computes from two
                                      others is not traced (among a file's thousands of
                                      values, some two divide to any ratio)
    pair     "9 / 16", "192/192"      both numbers side by side: two fields of one record,
                                      the same field of two records, or written so in one
                                      stored string

Numbers glued to a letter other than a unit ("16k", "5B", "x86") are labels, not read.
"""

from __future__ import annotations

import itertools
import re

_END = r"(?![\w]|\.\d)"  # the number is whole: no letter, digit or decimal part follows
_NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"  # "1,000.5": a comma only between groups of three
TOKEN = re.compile(r"(?<![\w.])(?>(?P<num>-?" + _NUM + "))"
                   r"(?:(?P<unit>x|%)" + _END + "|" + _END + ")")
PAIR = re.compile(r"(?<![\w./])(?<!/\s)(?P<a>" + _NUM + r")\s?/\s?(?P<b>" + _NUM + ")"
                  r"(?!\s?/\s?\d)" + _END)


class Pool:
    """What a results block may quote: every value, and the pairs stored side by side."""

    def __init__(self, data: list) -> None:
        self.values: set[float] = set()
        self.pairs: set[tuple[float, float]] = set()
        for obj in data:
            self._walk(obj)

    def _walk(self, obj) -> None:
        if isinstance(obj, dict):
            self._side_by_side(list(obj.values()), siblings=True)
            for v in obj.values():
                self._walk(v)
        elif isinstance(obj, list):
            self.values.add(float(len(obj)))  # "840 questions over 14 families": a count
            self._side_by_side(obj, siblings=False)
            for v in obj:
                self._walk(v)
        else:
            self.values.update(numbers_in(obj))
            if isinstance(obj, str):
                self.pairs.update((_num(m["a"]), _num(m["b"])) for m in PAIR.finditer(obj))

    def _side_by_side(self, items: list, siblings: bool) -> None:
        """Pairs among a record's scalars (not a list's: repeated runs are not a ratio), and
        between the same field of a container's records."""
        if siblings:
            scalars = [x for v in items if not isinstance(v, dict | list) for x in numbers_in(v)]
            self.pairs.update(itertools.combinations(scalars, 2))  # in the record's order
        records = [flat(v) for v in items if isinstance(v, dict)]
        for a, b in itertools.permutations(records, 2):
            self.pairs.update((a[k], b[k]) for k in a.keys() & b.keys())

    def has(self, shown: str, unit: str | None = None) -> bool:
        """Whether a number as shown (with its unit) is traced (module docstring)."""
        want, digits = _num(shown), _digits(shown)
        if unit == "%":
            return any(_rounds(100 * v, want, digits) or _rounds(v, want, digits)
                       for v in self.values)
        return any(_rounds(v, want, digits) for v in self.values)

    def has_pair(self, a: str, b: str) -> bool:
        pa, pb, da, db = _num(a), _num(b), _digits(a), _digits(b)
        return any(_rounds(x, pa, da) and _rounds(y, pb, db) for x, y in self.pairs)


def flat(record: dict, prefix: str = "") -> dict[str, float]:
    """A record's numeric leaves by their path."""
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}.")
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


def numbers_in(obj) -> list[float]:
    """The numbers of a stored leaf: itself, or those written in a string."""
    if isinstance(obj, bool) or obj is None:
        return []
    if isinstance(obj, int | float):
        return [float(obj)]
    return [_num(m["num"]) for m in TOKEN.finditer(str(obj))]


def untraced(body: str, pool: Pool) -> list[str]:
    """The numbers of a README block its pool does not account for."""
    bad = [m.group(0) for m in TOKEN.finditer(body) if not pool.has(m["num"], m["unit"])]
    return bad + [m.group(0) for m in PAIR.finditer(body) if not pool.has_pair(m["a"], m["b"])]


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _digits(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def _rounds(value: float, shown: float, digits: int) -> bool:
    """`value` written with `digits` decimals reads `shown` (half a last digit either way)."""
    return abs(value - shown) <= 0.5 * 10 ** -digits + 1e-9
