"""`make gpu-check`: the Pallas kernels and the engine on one NVIDIA GPU, in under 8 minutes.

    PYTHONPATH=. python3 -m experiments.gpu_check [--out DIR] [--budget-s 420] [--only PARTS]

Runs with the GPU machine's own python3 (jax with CUDA, numpy, jaxtyping; nothing installed)
and writes gpu_check.json (after every part, so a run stopped early keeps what it measured)
and gpu_check.png to --out ($OUT when set, else results/). Parts, in this order:

    env        device, JAX, which Pallas GPU backends this JAX has, the warnings they raise
    kernels    copy bandwidth; every kernel variant against the jnp reference
               (kernels/gpu_validate.py); decode at the target shape (batch 64, context 4k)
    agree_f32  engine tokens on the Pallas backend vs the reference backend, float32
    batch1     engine batch-1 decode vs its bandwidth roofline (bf16 weights)
    batch64    engine batch-64 throughput and decode step vs roofline
    grid       decode at batch 1 / 16 / 64 x context 1k / 4k / 16k (kernels/gpu_check.py)
    agree_bf16 bf16 tokens: reference, Triton and Mosaic GPU decode
    ragged     ragged prefill + decode at one shape
    mosaic     engine batch 1 and 64 with Mosaic GPU decode
    profile    one decode window of the engine at batch 1 and 64 under jax.profiler: device
               time by kernel beside the window's wall time (where a step's time goes)

`--only` runs some parts (also "target": decode at the target shape; "window_checks": the
windowed checks) and merges them into the existing results file: a session's second run
confirms its fixes without repeating what passed. Targets (issue 61) are judged in
`targets()` by the project's one rule (met: the median of paired rounds clears the bar by
more than their half-range).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

PARTS = ("env", "kernels", "agree_f32", "batch1", "batch64", "grid", "agree_bf16", "ragged",
         "mosaic", "profile")
EXTRA_PARTS = ("target", "window_checks")  # reruns of a piece of "kernels" (with --only)
# XLA's GEMM autotuning compiles many candidate kernels per matmul shape and step bucket;
# on a cold machine it would take most of the budget. Heuristic GEMM choices instead.
XLA_FLAGS = "--xla_gpu_autotune_level=0"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--only", nargs="*", choices=PARTS + EXTRA_PARTS,
                    help="these parts, merged into --merge-from")
    ap.add_argument("--merge-from", default="results/gpu_check.json",
                    help="with --only: the results file the parts are merged into")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, touch no device")
    return ap.parse_args(argv)


def environment() -> dict:
    """What this machine's JAX has: device, versions, Pallas GPU backends and their
    warnings (the Triton backend is deprecated in JAX 0.11)."""
    import jax

    env = dict(device=jax.devices()[0].device_kind, platform=jax.default_backend(),
               jax=jax.__version__, python=sys.version.split()[0],
               xla_flags=os.environ.get("XLA_FLAGS", ""), commit=_commit())
    pallas = "jax.experimental.pallas"
    for name, module in (("triton", f"{pallas}.triton"), ("mosaic_gpu", f"{pallas}.mosaic_gpu"),
                         ("jax_paged_attention", f"{pallas}.ops.gpu.paged_attention")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                __import__(module)
                env[name] = "ok"
            except Exception as e:
                env[name] = f"{type(e).__name__}: {e}"[:200]
        env[f"{name}_warnings"] = sorted({str(w.message)[:200] for w in caught})
    try:
        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        env["nvidia_smi"] = str(e)
    return env


CANARY = """
import jax, jax.numpy as jnp
from kernels.mosaic_decode import mosaic_decode_attention
from kernels.paged_attention import decode_reference, random_decode_inputs
args = random_decode_inputs(jax.random.PRNGKey(0), 4, 32, 8, 128, 16, 16, jnp.bfloat16)
out = mosaic_decode_attention(*args, num_splits=2, pages_per_step=8)
err = jnp.max(jnp.abs(out.astype(jnp.float32) - decode_reference(*args).astype(jnp.float32)))
print("max_err", float(err))
"""


def mosaic_canary(timeout_s: float = 120.0) -> str:
    """Runs the Mosaic GPU kernel once in a child process: a kernel that hangs on a barrier
    there costs `timeout_s`, not the whole check. "ok ..." or why not."""
    try:
        out = subprocess.run([sys.executable, "-c", CANARY], capture_output=True, text=True,
                             timeout=timeout_s, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    except subprocess.TimeoutExpired:
        return f"hung: no result in {timeout_s:.0f} s"
    if out.returncode:
        return f"failed: {out.stderr.strip()[-600:]}"
    err = float(out.stdout.split()[-1])
    return f"ok max_err={err:.3g}" if err < 3e-2 else f"wrong: max_err={err:.3g}"


def _commit() -> str:
    """The code measured: its commit, "+dirty" when the measured paths differ from it."""
    from experiments.common import CODE_STATE

    return CODE_STATE


def run_part(part: str, res: dict, deadline: float, log) -> None:
    """Runs one part into `res` (kernels / engine sections keyed by part)."""
    from experiments import gpu_engine
    from kernels import gpu_check as kc
    from kernels.gpu_timing import copy_bandwidth
    from kernels.gpu_validate import validate

    kern = res.setdefault("kernels", {})
    if part == "env":
        res["env"] = environment()
        res["env"]["mosaic_canary"] = canary = mosaic_canary()
        log(f"env: {res['env']}")
        if not canary.startswith("ok"):  # leave Mosaic GPU out of every later part
            os.environ["PAGED_JAX_SKIP_MOSAIC"] = "1"
    elif part == "kernels":
        kern["copy"] = copy_bandwidth()
        log(f"copy bandwidth {kern['copy']['gbps']:.0f} GB/s")
        t0 = time.perf_counter()
        kern["checks"] = validate()
        kern["checks_s"] = time.perf_counter() - t0
        bad = [c for c in kern["checks"] if not c["ok"]]
        log(f"checks: {len(kern['checks']) - len(bad)}/{len(kern['checks'])} pass"
            + "".join(f"\n  FAIL {c}" for c in bad))
        _decode(kern, [kc.TARGET_SHAPE], deadline, log)
    elif part == "target":
        _decode(kern, [kc.TARGET_SHAPE], deadline, log)
    elif part == "window_checks":
        from kernels.gpu_validate import validate_window

        new = validate_window(__import__("jax").random.PRNGKey(0))
        keys = {_check_key(c) for c in new}
        kern["checks"] = [c for c in kern.get("checks", []) if _check_key(c) not in keys
                          and not _check_key(c).endswith("w40")] + new
        log(f"window checks: {sum(c['ok'] for c in new)}/{len(new)} pass")
    elif part == "profile":
        res["profile"] = gpu_engine.profile(_copy_gbps(res) * 1e9, log, _out_dir())
    elif part == "grid":
        _decode(kern, [s for s in kc.grid() if s != kc.TARGET_SHAPE], deadline, log)
    elif part == "ragged":
        rows = kc.bench_ragged(*kc.RAGGED_SHAPE, _copy_gbps(res))
        kern["rows"] = [r for r in kern.get("rows", []) if r["kind"] != "ragged"] + rows
        log(kc.table(rows))
    else:
        eng = res.setdefault("engine", {})
        parts = {"mosaic": ("batch1:pallas-mosaic", "batch64:pallas-mosaic")}.get(part, (part,))
        if skip_mosaic() and part == "mosaic":
            eng.setdefault("parts", {})["mosaic"] = dict(skipped=res["env"]["mosaic_canary"])
            return
        new = gpu_engine.run_engine(_copy_gbps(res) * 1e9, parts, deadline, log)
        eng.setdefault("parts", {}).update(new["parts"])
        eng["model"] = new["model"]


def _out_dir() -> str | None:
    """Where large artifacts (profiles) go: $OUT on the GPU machine, else nowhere."""
    return os.environ.get("OUT") or None


def _check_key(c: dict) -> str:
    return f"{c['kind']} {c['variant']} {c['heads']} {c['d']} {c['dtype']}"


def skip_mosaic() -> bool:
    """Whether the canary found Mosaic GPU unusable on this machine (env part)."""
    return os.environ.get("PAGED_JAX_SKIP_MOSAIC") == "1"


def _decode(kern: dict, shapes, deadline: float, log) -> None:
    from kernels import dispatch
    from kernels import gpu_check as kc

    nq, h, _ = kc.BENCH_HEADS
    for batch, ctx in shapes:
        p = dispatch.decode_plan(batch, nq, h, kc.BLOCK, ctx // kc.BLOCK)  # what auto runs
        kern.setdefault("plan", {})[f"{batch}x{ctx}"] = (
            f"{p.kernel} x{p.num_splits} c{p.pages_per_step}")
        if time.perf_counter() > deadline:
            kern.setdefault("skipped", []).append([batch, ctx])
            continue
        rows = kc.bench_decode(batch, ctx, kern["copy"]["gbps"], (batch, ctx) in kc.TUNE_SHAPES)
        kern["rows"] = [r for r in kern.get("rows", [])
                        if (r["kind"], r["batch"], r["ctx"]) != ("decode", batch, ctx)] + rows
        log(kc.table(rows))


def _copy_gbps(res: dict) -> float:
    copy = res.get("kernels", {}).get("copy")
    if copy is None:
        from kernels.gpu_timing import copy_bandwidth

        res.setdefault("kernels", {})["copy"] = copy = copy_bandwidth()
    return copy["gbps"]


def targets(res: dict) -> dict:
    """Issue 61's targets from one run's results: {name: dict(..., met)}. Timed targets take
    the project's one rule (experiments/common.target_verdict): met when the median of the
    paired rounds clears the bar by more than their half-range."""
    from experiments.common import target_verdict
    from kernels import gpu_check as kc
    from kernels.gpu_timing import per_round_ratio

    out = {}
    kern, parts = res.get("kernels", {}), res.get("engine", {}).get("parts", {})
    checks = kern.get("checks", [])
    out["kernel checks"] = dict(value=f"{sum(c['ok'] for c in checks)}/{len(checks)}",
                                met=bool(checks) and all(c["ok"] for c in checks))
    f32 = parts.get("agree_f32", {}).get("backends", {}).get("pallas", {})
    out["engine tokens equal (float32)"] = dict(
        value=f"{f32.get('tokens_equal')}/{f32.get('tokens')}",
        met=bool(f32.get("tokens")) and f32.get("tokens_equal") == f32.get("tokens"))
    b, c = kc.TARGET_SHAPE
    rows = {r["name"]: r for r in kern.get("rows", [])
            if (r["kind"], r["batch"], r["ctx"]) == ("decode", b, c) and "ms" in r}
    auto = rows.get(kern.get("plan", {}).get(f"{b}x{c}"))
    peers = [r for n, r in rows.items() if n.startswith("jax_pallas")]
    copy = kern.get("copy", {}).get("gbps")
    if auto and copy:
        pct = [100 * kc.kv_bytes(b, c) / t / 1e9 / copy for t in auto["times"]]
        out[f"decode b{b} ctx{c} % copy"] = dict(
            kernel=auto["name"], **_verdict(target_verdict(pct, 70.0)))
        if peers:
            peer = min(peers, key=lambda r: r["ms"])
            out[f"decode b{b} ctx{c} vs JAX"] = dict(
                kernel=auto["name"], peer=peer["name"],
                **_verdict(target_verdict(per_round_ratio(auto, peer), 1.2)))
    b1 = parts.get("batch1", {})
    if "share_per_window" in b1:
        out["engine batch-1 decode % roofline"] = _verdict(
            target_verdict([100 * x for x in b1["share_per_window"]], 60.0))
    return out


def _verdict(v: dict) -> dict:
    return dict(median=round(v["median"], 3), bar=v["target"], spread=round(v["spread"], 3),
                verdict=v["verdict"], met=v["verdict"] == "met")


def save(res: dict, out: Path) -> None:
    """gpu_check.json with its targets and the provenance of the last part run (each part's
    own commit and time are in res["runs"])."""
    from experiments.common import provenance

    out.mkdir(parents=True, exist_ok=True)
    res["targets"] = targets(res)
    device = res.get("env", {}).get("device", "unknown")
    res["provenance"] = {**provenance({"device": device}), "experiment": "experiments.gpu_check",
                         "command": "make gpu-check " + " ".join(sys.argv[1:])}
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))


def plot(res: dict, out: Path) -> Path | None:
    """GB/s of K/V read by decode at each batch (a panel each) and context: the dispatcher's
    plan on Triton and on Mosaic GPU and JAX's kernel at its better split count, beside the
    copy bandwidth."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from kernels import gpu_check as kc

    kern = res.get("kernels", {})
    rows = [r for r in kern.get("rows", []) if r["kind"] == "decode" and "gbps" in r]
    fig, axes = plt.subplots(1, len(kc.BATCHES), figsize=(12, 3.8), sharey=True)
    for ax, batch in zip(axes, kc.BATCHES, strict=True):
        for family in ("triton", "mosaic", "jax_pallas"):
            best = {}
            for r in rows:
                if r["batch"] == batch and r["name"].split()[0] == family:
                    if r["ctx"] not in best or r["gbps"] > best[r["ctx"]]:
                        best[r["ctx"]] = r["gbps"]
            if best:
                ax.plot(*zip(*sorted(best.items()), strict=True), marker="o", label=family)
        if kern.get("copy"):
            ax.axhline(kern["copy"]["gbps"], color="k", ls="--", label="copy bandwidth")
        ax.set(xscale="log", xlabel="context (tokens)", title=f"batch {batch}")
    axes[0].set_ylabel("GB/s of K/V read")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"decode attention, bf16, 32/8 heads x 128, "
                 f"{res.get('env', {}).get('device', '?')}")
    fig.tight_layout()
    path = out / "gpu_check.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = args.only or PARTS
    print(f"gpu-check parts: {', '.join(parts)}; budget {args.budget_s:.0f} s")
    if args.dry_run:
        return 0
    os.environ.setdefault("XLA_FLAGS", XLA_FLAGS)
    from kernels.gpu_check import has_gpu

    if not has_gpu():
        print("gpu_check: no GPU visible to JAX (jax.devices('gpu') is empty); nothing to "
              "check. Run on a CUDA machine.", file=sys.stderr)
        return 2
    t_start, out = time.perf_counter(), Path(args.out)
    res = {}
    if args.only and Path(args.merge_from).exists():
        res = json.loads(Path(args.merge_from).read_text())
    deadline = t_start + args.budget_s
    log = lambda msg: print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)  # noqa: E731
    for part in parts:
        t0 = time.perf_counter()
        try:
            run_part(part, res, deadline, log)
        except Exception as e:  # keep the other parts whatever happens to this one
            res.setdefault("errors", {})[part] = f"{type(e).__name__}: {e}"[:800]
            log(f"part {part} FAILED: {res['errors'][part]}")
        res.setdefault("part_s", {})[part] = time.perf_counter() - t0
        res.setdefault("runs", {})[part] = dict(commit=_commit(), at=time.strftime("%F %T"))
        save(res, out)
        log(f"part {part} done in {res['part_s'][part]:.1f} s")
    plot(res, out)
    for name, t in res["targets"].items():
        print(f"target {name}: {t}")
    return 0 if all(t["met"] for t in res["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
