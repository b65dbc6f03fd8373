"""The runner's compiled programs: one table, filled ahead of time (warm-up) or on first use.

Each jitted engine function (run_step, run_verify, decode_window, run_ops) is lowered and
compiled explicitly (`fn.lower(...).compile()`, JAX's ahead-of-time path) and the compiled
program kept under its key: the function, its static arguments (StepConfig, StepShape, ...)
and the types and shapes of the arguments that change from call to call (the batch; the
parameters and the state keep theirs for a runner's life). Two reasons to hold them here
rather than in jit's own cache:

- warm-up (engine/warmup.py) compiles programs without running them: nothing touches the
  device state, and a server can build its programs while requests wait;
- `built` counts what this table compiled, so "no program built after warm-up" is a fact
  the engine knows, not an inference from timings.

A compiled program is called through JAX's C++ dispatch as a jitted function is (measured:
no slower per call), and honours the function's donated arguments.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from paged_jax import compile_cache


def _signature(x: Any, placed: bool = False) -> tuple:
    """What a program is specialised on for one argument leaf (jit's own key); `placed` adds
    the leaf's devices (host arrays have none: they are copied in)."""
    if isinstance(x, np.ndarray | jax.Array):
        where = str(x.sharding) if placed and isinstance(x, jax.Array) else None
        return (x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)), where)
    return (type(x).__name__, x if isinstance(x, bool | int | float | str | None) else None)


_LAYOUTS: dict[tuple, int] = {}


def layout_of(tree: Any) -> int:
    """A small number for the signature of arguments that keep their types, shapes and
    devices for a runner's life (parameters, device state): computed once per runner, it
    stands for them in every key (equal layouts, equal numbers)."""
    leaves, treedef = jax.tree.flatten(tree)
    sig = (treedef, tuple(_signature(x, placed=True) for x in leaves))
    return _LAYOUTS.setdefault(sig, len(_LAYOUTS))


def key_of(fn: Callable, layout: int, keyed: tuple, static: dict) -> tuple:
    """A program's key: the function, its static arguments, the runner's layout and
    `keyed`'s leaves' signatures."""
    leaves, tree = jax.tree.flatten(keyed)
    return (fn.__name__, layout, tuple(sorted(static.items())), tree,
            tuple(_signature(x) for x in leaves))


_unchecked_lock = threading.Lock()
_unchecked_depth, _unchecked_before = 0, False


@contextlib.contextmanager
def _unchecked():
    """jaxtyping's run-time checks off while JAX describes the arguments: it rebuilds each
    argument dataclass with ArgInfo leaves, which a checked constructor (tests/conftest.py's
    import hook) refuses. Tracing, where the checks matter, stays checked."""
    global _unchecked_depth, _unchecked_before
    import jaxtyping

    with _unchecked_lock:
        if not _unchecked_depth:
            _unchecked_before = jaxtyping.config.jaxtyping_disable
        _unchecked_depth += 1
        jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        with _unchecked_lock:
            _unchecked_depth -= 1
            if not _unchecked_depth:
                jaxtyping.config.update("jaxtyping_disable", _unchecked_before)


class Programs:
    """Compiled programs by key (see the module docstring); thread-safe. One table per
    process (`PROGRAMS`), as jit's own cache is: engines of the same model and configuration
    share their programs."""

    def __init__(self) -> None:
        self._table: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.built = 0  # programs this table compiled (ahead of time or on first use)
        self.built_by: collections.Counter[str] = collections.Counter()  # by function name

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key: tuple) -> bool:
        return key in self._table

    def call(self, fn: Callable, layout: int, args: tuple, keyed: tuple, static: dict) -> Any:
        """`fn(*args, **static)` through its compiled program (compiled now if new).
        `layout`: the fixed arguments' (`layout_of`); `keyed`: the arguments whose shapes
        vary between calls (see `key_of`)."""
        key = key_of(fn, layout, keyed, static)
        program = self._table.get(key)
        if program is None:
            program = self.build(fn, args, key, static)
        return program(*args)

    def build(self, fn: Callable, args: tuple, key: tuple, static: dict) -> Any:
        """Compiles `fn` for `args` (their types and shapes: nothing runs) under `key`."""
        traced = fn.trace(*args, **static)  # the function's shape checks run here
        with _unchecked():
            lowered = traced.lower()
        program = lowered.compile()
        with self._lock:
            if key not in self._table:
                self._table[key] = program
                self.built += 1
                self.built_by[key[0]] += 1
            return self._table[key]

    def clear(self) -> None:
        """Drops every program (they rebuild on use; see compile_cache.relieve_jit_mappings)."""
        with self._lock:
            self._table.clear()


PROGRAMS = Programs()
compile_cache.on_clear(PROGRAMS.clear)
