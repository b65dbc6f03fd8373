"""Warm-up: the programs an engine's configuration meets, built before it serves.

A program is built the first time a step meets its static shape (engine/batch.py's bucket
rules), and on a CPU an engine step takes seconds to compile: a server that builds while it
serves makes a request that arrives mid-decode wait for a compile (issue 57 measured 1.9 s
against a 95 ms idle TTFT). Warm-up enumerates the shapes the bucket rules can produce for
this configuration and compiles each ahead of time (engine/programs.py: lowered from padding
batches of the right types and shapes; nothing runs, the device state is untouched), two at
a time on two cores. With the persistent compile cache (paged_jax/compile_cache.py) a second
start loads them instead.

Levels (`paged-jax serve --warmup`, `Engine.warm_up`):

    none    nothing ahead of time: each program is built when first met.
    auto    every shape of plain serving, for greedy and for sampled requests (temperature
            > 0 without top-k / top-p / min-p): decode-only steps at each row bucket (with
            and without admissions, with copy-on-write when prefix caching can share a
            partly filled block), prefill / mixed steps at each token bucket, decode windows
            when the engine runs them, and the allocator's ops-only call.
    full    auto, and the same shapes for top-k / top-p / min-p filters and for requests
            asking logprobs (three times auto's programs).

Not covered (built on first use, counted by `paged_jax:xla_programs_built`): penalties and
logit bias, speculative decoding's verify steps, structured outputs' masks, prompt
logprobs, hidden states, n > 1 forks and beam search, swap-ins.

Each XLA:CPU step program holds 660-875 memory mappings (three per kernel: measured on
SmolLM2, float32 and bfloat16), and past compile_cache.RELIEVE_AT (85%) of
`vm.max_map_count` the process drops its programs (compile_cache.relieve_jit_mappings): a
level that would get there is refused before it builds anything, with the count. `auto` at
the server's defaults (16 sequences, 256 tokens a step) is 55 programs, about 48,000 of the
65,530 mappings Linux allows by default; `full` needs a higher vm.max_map_count.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator

import numpy as np

from paged_jax.engine import batch as batch_lib
from paged_jax.engine.programs import key_of
from paged_jax.engine.step import StepBatch, StepShape
from paged_jax.sample import sampler as smp
from paged_jax.sizes import cdiv, next_pow2

LEVELS = ("none", "auto", "full")
MAPPINGS_PER_PROGRAM = 900  # measured 660-875 on SmolLM2's step programs (module docstring)


@dataclasses.dataclass(frozen=True)
class Item:
    """One program to build: its phase (for progress), kind and padding arguments."""

    phase: str
    kind: str  # "step", "window" or "ops"
    shape: StepShape | None = None
    rows: int = 0
    tokens: int = 0
    admit: bool = False


def flag_sets(level: str, ec) -> list[smp.SampleFlags]:
    """The sampler features each warmed program is built for."""
    if ec.static_shapes:  # one set whatever the requests ask (batch._flags)
        return [smp.SampleFlags(num_top_logprobs=ec.max_logprobs)]
    greedy = smp.SampleFlags(random=False, filters=False, penalties=False, logprobs=False,
                             bias=False)
    sets = [greedy, dataclasses.replace(greedy, random=True)]
    if level == "full":
        sets.append(dataclasses.replace(greedy, random=True, filters=True))
        j = ec.max_logprobs  # a request asking logprobs gets J top logprobs back
        sets += [dataclasses.replace(f, logprobs=True, num_top_logprobs=j) for f in sets]
    return list(dict.fromkeys(sets))


def _pages(ec, backend: str, rows: int, window: bool) -> list[dict]:
    """The page-bucket fields a shape can carry on this backend (batch._pages and
    build_window): none on the C++ kernel."""
    p = cdiv(ec.max_model_len, ec.block_size)
    if window and backend == "reference":
        return [dict(decode_pages=1 << i) for i in range((rows * p - 1).bit_length() + 1)
                if 1 << i <= next_pow2(rows * p)]
    if backend in batch_lib.PAGED_COST_BACKENDS and (not window or backend != "reference"):
        return [dict(max_pages=min(1 << i, p)) for i in range((p - 1).bit_length() + 1)]
    return [{}]


def plan(level: str, ec, backend: str, shares_blocks: bool) -> list[Item]:
    """Every program `level` builds for an engine of config `ec` (see the module docstring).

    Args:
      level: "none", "auto" or "full".
      ec: the engine config.
      backend: the attention backend (its page buckets, its max_q buckets).
      shares_blocks: a partly filled last block may be shared (prefix caching, forks): steps
        then come with and without copy-on-write.
    """
    if level not in LEVELS:
        raise ValueError(f"warm-up level {level!r}: expected one of {', '.join(LEVELS)}")
    if level == "none":
        return []
    items = [Item("ops", "ops")]
    for flags in flag_sets(level, ec):
        items += list(_steps(ec, backend, shares_blocks, flags))
        if ec.decode_window > 1 and not ec.async_scheduling:
            items += list(_windows(ec, backend, shares_blocks, flags))
    if ec.lora is not None:  # calls with adapter rows are programs of their own (batch.py)
        lora = [dataclasses.replace(i, shape=dataclasses.replace(i.shape, lora=True))
                for i in items if i.shape is not None]
        items = [i for i in items if i.shape is None or not ec.static_shapes] + lora
    return items


def _shape(ec, max_q: int, r: int, copies: bool, flags, pages: dict) -> StepShape:
    return batch_lib.step_shape(ec, max_q, r * ec.num_groups if copies else 0, flags, **pages)


def _steps(ec, backend: str, shares: bool, flags) -> Iterator[Item]:
    if ec.static_shapes:
        r, t = batch_lib._step_buckets([], 0, ec)
        for pages in _pages(ec, backend, r, False):
            yield Item("static", "step", _shape(ec, t, r, True, flags, pages), r, t, True)
        return
    s = next_pow2(ec.max_num_seqs)
    for r in (1 << i for i in range(s.bit_length())):  # decode-only: T = R, max_q 1
        for admit, copies in ((False, False), (True, False), (True, True))[:3 if shares else 2]:
            for pages in _pages(ec, backend, r, False):
                yield Item("decode", "step", _shape(ec, 1, r, copies, flags, pages), r, r,
                           admit)
    paged = backend in batch_lib.PAGED_COST_BACKENDS
    for t in batch_lib.token_buckets(ec):  # prefill chunks: R = every slot, admissions sent
        for max_q in sorted({t, max(1, t // 8)} if paged else {t}):
            long_rows = [1, 4, s] if backend == "reference" else [None]
            for lr, copies, pages in ((lr, c, p) for lr in long_rows
                                      for c in (False, True)[:2 if shares else 1]
                                      for p in _pages(ec, backend, s, False)):
                shape = dataclasses.replace(_shape(ec, max_q, s, copies, flags, pages),
                                            max_q_rows=min(lr, s) if lr else None)
                yield Item("prefill", "step", shape, s, t, True)


def _windows(ec, backend: str, shares: bool, flags) -> Iterator[Item]:
    s = ec.max_num_seqs if ec.static_shapes else next_pow2(ec.max_num_seqs)
    rows = [s] if ec.static_shapes else [1 << i for i in range(s.bit_length())]
    full = cdiv(ec.decode_window, ec.block_size) if ec.enable_prefix_caching else 0
    for r in rows:
        for copies in (False, True)[:2 if shares or ec.static_shapes else 1]:
            for pages in _pages(ec, backend, r, True):
                yield Item("window", "window", StepShape(
                    max_q=1, max_copies=r * ec.num_groups if copies else 0, flags=flags,
                    full_width=full, **pages), r, r)


def padding_step(ec, item: Item, eos_ids: list[int], vocab_size: int) -> StepBatch:
    """A step batch of `item`'s types and shapes, every row padding (batch.build_step)."""
    r, t = item.rows, item.tokens
    f = ec.max_num_seqs if ec.static_shapes else next_pow2(0)
    ints = lambda n, v: np.full(n, v, np.int32)  # noqa: E731
    admit = (batch_lib.build_admissions([], ec, item.shape.flags, eos_ids, vocab_size)
             if item.admit else None)
    return StepBatch(ints(t, 0), ints(t, 0), ints(t, -1), ints(r, -1), ints(r + 1, 0),
                     np.zeros(r, bool), ints(f, -1), ints(f, -1), ints(f, -1), admit=admit,
                     ops=batch_lib.build_ops(None, ec), own=np.zeros(r, bool))


@dataclasses.dataclass
class Report:
    """What a warm-up did: programs it built (compiled or loaded from the persistent cache),
    those already built in this process, and the seconds it took."""

    level: str
    planned: int = 0
    built: int = 0
    present: int = 0
    seconds: float = 0.0


def missing(runner, level: str, eos_ids: list[int], vocab_size: int) -> tuple[list, int]:
    """([(item, fn, args, key, static)] of `plan`'s programs not built yet, how many are);
    refuses, before anything is built, a level past the memory-mapping limit."""
    ec = runner.config
    items = plan(level, ec, runner.cfg.backend, ec.enable_prefix_caching)
    todo = []
    for item in items:
        fn, args, keyed, static = runner.program_args(_call(ec, item, eos_ids, vocab_size))
        key = key_of(fn, runner.layout, keyed, static)
        if key not in runner.programs:
            todo.append((item, fn, args, key, static))
    _check_mappings(len(todo), level)
    return todo, len(items) - len(todo)


def run(runner, level: str, eos_ids: list[int], vocab_size: int,
        progress: Callable[[str, int, int], None] | None = None) -> Report:
    """Builds every program of `plan` for `runner` (engine/runner.py), in two threads.

    Args:
      runner: the engine's runner (its programs, params, state and configs).
      level: see LEVELS.
      eos_ids, vocab_size: the model's (admission rows carry them).
      progress: called as (phase, done, total) after each program.
    """
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    todo, present = missing(runner, level, eos_ids, vocab_size)
    with ThreadPoolExecutor(max(1, min(2, os.cpu_count() or 1))) as pool:
        jobs = [(item, pool.submit(runner.programs.build, fn, args, key, static))
                for item, fn, args, key, static in todo]
        for done, (item, job) in enumerate(jobs, start=1):
            job.result()
            if progress:
                progress(item.phase, done, len(jobs))
    return Report(level, len(todo) + present, len(todo), present, time.perf_counter() - t0)


def _call(ec, item: Item, eos_ids: list[int], vocab_size: int) -> batch_lib.Call:
    """The Call of `item`, every row padding."""
    ops = batch_lib.build_ops(None, ec)
    if item.kind == "ops":
        return batch_lib.Call("ops", [], ops)
    if item.kind == "window":
        window = (np.full(item.rows, -1, np.int32), np.zeros(item.rows, np.int32))
        return batch_lib.Call("window", [], ops, item.shape, window=window)
    return batch_lib.Call("step", [], ops, item.shape,
                          padding_step(ec, item, eos_ids, vocab_size))


def _check_mappings(n: int, level: str) -> None:
    """Refuses, before building, a warm-up whose programs would take an XLA:CPU process past
    the share of the kernel's memory-mapping limit at which compile_cache.relieve_jit_mappings
    drops every program (they would be built again while serving)."""
    import jax

    from paged_jax.compile_cache import RELIEVE_AT, _count_lines

    try:
        limit = int(open("/proc/sys/vm/max_map_count").read())
        used = _count_lines("/proc/self/maps")
    except OSError:
        return
    need = n * MAPPINGS_PER_PROGRAM
    if jax.default_backend() == "cpu" and used + need > RELIEVE_AT * limit:
        raise ValueError(
            f"warm-up {level!r} would build {n} programs, about {need:,} memory mappings on "
            f"XLA:CPU beside the {used:,} in use: past {RELIEVE_AT:.0%} of vm.max_map_count "
            f"({limit:,}), "
            "where the process drops its programs. Use --warmup auto (or none), fewer "
            "max_num_seqs / max_num_batched_tokens buckets, or raise the limit (sysctl "
            "vm.max_map_count)")
