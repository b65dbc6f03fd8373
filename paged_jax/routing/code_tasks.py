"""Code questions whose answers are checked by Python, for a weak / strong pair of code models.

    family    question                                         difficulty d
    pyeval    "What does `sorted('cab')[1]` evaluate to?"      1..3: one operation, a
                                                               method chain, a comprehension
    pyfunc    "def f(xs): ... What does f([3, 8, 1]) return?"  1..3: one expression, a loop
                                                               with a branch, nested loops
    pyfix     "`def f(n): return sum(range(n))` should pass    1..3: an operator, an
              `f(4) == 10`. Give the fixed line."              off-by-one, the wrong method

Answers to pyeval / pyfunc are the repr of what Python computes for the generated code; a
completion is right when `ast.literal_eval` of its first line equals that value (so 'a' and
"a" both count; nothing is executed). A pyfix completion is right when its first line,
defining f, passes the question's test: the line must be a plain `def f` (`plain_def`: no
imports, defaults, decorators or dunder names), then `run_fix` runs it in a separate
`python -I` process with a time limit, an empty environment and folder, memory and file
limits and the socket module removed (model output is untrusted code; this bounds what one
line can do, it is not a sandbox).
"""

from __future__ import annotations

import ast
import random
import subprocess
import sys

TIME_LIMIT = 5.0  # seconds for one pyfix check
LETTERS = "abcdefghkmnprstuw"


def _word(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(n))


def _ints(rng: random.Random, n: int, hi: int = 9) -> list[int]:
    return [rng.randint(0, hi) for _ in range(n)]


def _pyeval_expr(rng: random.Random, d: int) -> str:
    if d == 1:
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
        return rng.choice([f"{a} * {b} - {c}", f"len('{_word(rng, a)}') + {b}",
                           f"{a * b + c} // {b}", f"{a * b + c} % {a}"])
    if d == 2:
        w, xs = _word(rng, rng.randint(3, 6)), _ints(rng, rng.randint(3, 5))
        return rng.choice([f"sorted('{w}')[{rng.randint(0, 2)}]", f"'{w}'.upper()[::-1]",
                           f"max({xs}) - min({xs})", f"{xs}[1:] + {xs}[:1]",
                           f"'{w}'.count('{w[0]}') * {rng.randint(2, 5)}"])
    n, k = rng.randint(4, 8), rng.randint(2, 3)
    return rng.choice([f"[x * x for x in range({n}) if x % {k}]",
                       f"sum(x for x in range({n}) if x % {k} == 0)",
                       f"'-'.join(sorted('{_word(rng, 4)}'))",
                       f"{{c: i for i, c in enumerate('{_word(rng, 3)}')}}",
                       "[len(w) for w in '{}'.split()]".format(" ".join(
                           _word(rng, rng.randint(1, 6)) for _ in range(rng.randint(2, 4))))])


def pyeval(rng: random.Random, d: int) -> tuple[str, str]:
    expr = _pyeval_expr(rng, d)
    return f"What does `{expr}` evaluate to?", repr(eval(expr))  # our own generated code


_FUNCS = {
    1: [("def f(n): return n * {a} + {b}", lambda r: r.randint(1, 9)),
        ("def f(s): return s[{c}:] + s[:{c}]", lambda r: repr(_word(r, 5))),
        ("def f(xs): return xs[-1] * {a}", lambda r: _ints(r, 3))],
    2: [("def f(xs):\n    t = 0\n    for x in xs:\n        if x > {a}:\n            t += x\n"
         "    return t", lambda r: _ints(r, 5)),
        ("def f(s):\n    out = ''\n    for c in s:\n        if c not in out:\n"
         "            out += c\n    return out", lambda r: repr(_word(r, 6))),
        ("def f(n):\n    k = 0\n    while n > {a}:\n        n //= 2\n        k += 1\n"
         "    return k", lambda r: r.randint(20, 200))],
    3: [("def f(xs):\n    out = []\n    for i in range(len(xs)):\n"
         "        for j in range(i + 1, len(xs)):\n            if xs[i] + xs[j] == {a}:\n"
         "                out.append((i, j))\n    return out", lambda r: _ints(r, 5)),
        ("def f(s):\n    counts = {{}}\n    for c in s:\n        counts[c] = counts.get(c, 0)"
         " + 1\n    return sorted(counts.items())[:{a}]", lambda r: repr(_word(r, 7))),
        ("def f(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b"
         "\n    return a % {a}", lambda r: r.randint(5, 15))],
}


def pyfunc(rng: random.Random, d: int) -> tuple[str, str]:
    template, arg = rng.choice(_FUNCS[d])
    code = template.format(a=rng.randint(2, 9), b=rng.randint(1, 9), c=rng.randint(1, 4))
    x = arg(rng)
    scope: dict = {}
    exec(code, scope)  # our own generated code
    value = scope["f"](ast.literal_eval(str(x)))
    return f"{code}\nWhat does f({x}) return?", repr(value)


def _bugs(rng: random.Random, d: int) -> tuple[str, str, str]:
    """(right line, buggy line, test) of one bug of difficulty d."""
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    xs = [rng.randint(10, 99) for _ in range(4)]
    w = _word(rng, 5)
    bugs = {
        1: [("def f(a, b): return a * b", "def f(a, b): return a + b",
             f"f({a}, {b}) == {a * b}"),
            ("def f(xs): return max(xs)", "def f(xs): return min(xs)", f"f({xs}) == {max(xs)}"),
            ("def f(a, b): return a - b", "def f(a, b): return b - a",
             f"f({a + b}, {b}) == {a}")],
        2: [("def f(n): return sum(range(n + 1))", "def f(n): return sum(range(n))",
             f"f({a}) == {sum(range(a + 1))}"),
            ("def f(xs): return xs[-1]", "def f(xs): return xs[len(xs) - 2]",
             f"f({xs}) == {xs[-1]}"),
            ("def f(s): return s[:3]", "def f(s): return s[:2]", f"f('{w}') == '{w[:3]}'")],
        3: [("def f(s): return s.upper()", "def f(s): return s.lower()",
             f"f('{w}') == '{w.upper()}'"),
            ("def f(s): return s[::-1]", "def f(s): return s[::1]",
             f"f('{w}') == '{w[::-1]}'"),
            ("def f(xs): return sorted(xs, reverse=True)", "def f(xs): return sorted(xs)",
             f"f({xs}) == {sorted(xs, reverse=True)}")],
    }
    return rng.choice(bugs[d])


def _passes(line: str, test: str) -> bool:
    scope: dict = {}
    exec(line, scope)  # our own generated code
    return bool(eval(test, scope))


def pyfix(rng: random.Random, d: int) -> tuple[str, str]:
    right, wrong, test = _bugs(rng, d)
    while _passes(wrong, test):  # e.g. a + b == a * b at 2, 2: that bug would not show
        right, wrong, test = _bugs(rng, d)
    return (f"`{wrong}` should pass `assert {test}`. Give the fixed line.",
            f"{right}\nassert {test}")


def _first_line(completion: str) -> str:
    return completion.strip().split("\n", 1)[0].strip()


def check(family: str, answer: str, completion: str) -> bool:
    """Whether a completion answers a code question (see the module docstring)."""
    line = _first_line(completion).strip("`")
    if family == "pyfix":
        test = answer.split("\n", 1)[1]
        return line.startswith("def f(") and run_fix(line, test)
    try:
        got, want = ast.literal_eval(line), ast.literal_eval(answer)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return got == want and repr(got) == repr(want)  # True is not 1, 1.0 is not 1


def plain_def(line: str) -> bool:
    """Whether `line` only defines f: no defaults, annotations or decorators (evaluated when
    the def runs, before the test), no imports, no dunder names or private attributes."""
    try:
        tree = ast.parse(line)
    except (SyntaxError, ValueError):
        return False
    if len(tree.body) != 1 or not isinstance(fn := tree.body[0], ast.FunctionDef):
        return False
    a = fn.args
    if (fn.name != "f" or fn.decorator_list or fn.returns or a.defaults or any(a.kw_defaults)
            or any(x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])):
        return False
    return not any(isinstance(n, ast.Import | ast.ImportFrom | ast.Global | ast.Nonlocal)
                   or (isinstance(n, ast.Name) and n.id.startswith("__"))
                   or (isinstance(n, ast.Attribute) and n.attr.startswith("_"))
                   for n in ast.walk(fn))


_HARNESS = "import sys\nsys.modules['socket'] = sys.modules['_socket'] = None\n"


def _limits() -> None:  # in the child, before it runs anything
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


def run_fix(line: str, test: str) -> bool:
    """Runs one proposed line and its test in a separate isolated interpreter (an empty
    folder, no environment, 1 GiB of memory, no file writes, killed with its process group
    after TIME_LIMIT seconds)."""
    import os
    import signal
    import tempfile

    if not plain_def(line):
        return False
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", f"{_HARNESS}{line}\n{test}\n"], cwd=cwd, env={},
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_limits)
        try:
            return proc.wait(TIME_LIMIT) == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return False


def shot_answer(family: str, answer: str) -> str:
    """What a worked example shows as its answer (pyfix: the fixed line, not its test)."""
    return answer.split("\n", 1)[0] if family == "pyfix" else answer


CODE_FAMILIES = {"pyeval": (pyeval, range(1, 4)), "pyfunc": (pyfunc, range(1, 4)),
                 "pyfix": (pyfix, range(1, 4))}
