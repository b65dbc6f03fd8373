"""routing/code_tasks.py: code questions, their answers computed by Python, and the checks of a
model's completion (literal values; a proposed fix run in a separate, time-limited process)."""

from __future__ import annotations

import random
import re

import pytest

from paged_jax.routing import code_tasks
from paged_jax.routing.tasks import CODE_FAMILIES, FAMILIES, SHOTS, make_item, make_items

CODE = tuple(CODE_FAMILIES)


def test_code_items_are_seeded_and_cover_every_difficulty():
    a, b = make_items(45, seed=5, families=CODE), make_items(45, seed=5, families=CODE)
    assert a == b
    assert {(it.family, it.difficulty) for it in a} == {
        (f, d) for f, (_, ds) in CODE_FAMILIES.items() for d in ds}
    assert not set(CODE) & {it.family for it in make_items(100)}  # not in the default set
    assert not set(CODE) & set(FAMILIES)


@pytest.mark.parametrize("family", ["pyeval", "pyfunc"])
def test_values_are_compared_not_their_spelling(family):
    for it in make_items(12, seed=1, families=(family,)):
        assert it.correct(f" {it.answer}\nQ: next")
        if it.answer.startswith("'"):  # the other quote is the same value
            assert it.correct(' "' + it.answer[1:-1] + '"')
        assert not it.correct(" None") and not it.correct(" __import__('os')")


def test_a_fix_is_run_against_its_test():
    for d in (1, 2, 3):
        it = make_item("pyfix", d, random.Random(d))
        right = it.answer.split("\n", 1)[0]
        wrong = it.prompt.rsplit("Q: `", 1)[1].split("`", 1)[0]
        assert it.correct(f" {right}\nQ: next"), right
        assert not it.correct(f" {wrong}"), wrong
        assert not it.correct(" print('no function')")
        # worked examples show their fixed line (which passes their own test), never a test
        answers = [x[3:] for x in it.prompt.splitlines() if x.startswith("A: ")]
        tests = re.findall(r"should pass `(assert [^`]*)`\. Give the fixed line\.", it.prompt)
        assert len(answers) == SHOTS and len(tests) == SHOTS + 1
        for a, t in zip(answers, tests[:-1], strict=True):
            assert a.startswith("def f(") and "assert" not in a, a
            assert code_tasks.run_fix(a, t), (a, t)


def test_untrusted_lines_are_bounded(monkeypatch):
    monkeypatch.setattr(code_tasks, "TIME_LIMIT", 1.0)
    assert not code_tasks.run_fix("def f(n):\n    while True: pass", "f(1)")
    assert not code_tasks.run_fix("import socket\ndef f(): pass", "f()")
    assert not code_tasks.run_fix("def f(): return __import__('socket')", "f()")
    # defaults run when the def does, before the test: refused without running
    assert not code_tasks.run_fix("def f(a=sys.exit(0)): return 1", "assert f() == 2")
    assert not code_tasks.run_fix("def f(): return sys.modules['os']._exit(0)", "f()")
    assert code_tasks.run_fix("def f(n): return n + 1", "assert f(1) == 2")
    assert not code_tasks.run_fix("def f(n): return n + 1", "assert f(1) == 3")


def test_values_compare_with_their_types():
    assert code_tasks.check("pyeval", "1", " 1") and not code_tasks.check("pyeval", "1", " True")
    assert not code_tasks.check("pyeval", "1", " 1.0")
