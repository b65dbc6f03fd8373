# ruff: noqa: E501  (HLO lines are as XLA writes them)
"""experiments/step_profile.py: XLA's optimized HLO names each thunk's kind, the device's busy
time is the union of its thunks, and a quick run splits real steps."""

from __future__ import annotations

import pytest

from experiments import step_profile as sp

HLO = '''
%fused_computation.1 (p: f32[4,8], w: f32[8,8]) -> f32[4,8] {
  %dot.1 = f32[4,8] dot(%p, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%fused_computation.2 (p: f32[4,8]) -> f32[4,8] {
  %rsqrt.1 = f32[4,8] rsqrt(%p)
}

ENTRY %main {
  %dot_fusion = f32[4,8] fusion(%a, %b), kind=kOutput, calls=%fused_computation.1, metadata={op_name="jit(f)/x"}
  %loop_fusion = f32[4,8] fusion(%a), kind=kLoop, calls=%fused_computation.2, metadata={op_name="jit(run_step)/jit(decoder_layer)/norm/mul"}
  %custom-call.3 = f32[4,8] custom-call(%a), custom_call_target="paged_jax_cpu_attention", metadata={op_name="jit(f)/attention/ffi"}
  %argmax = s32[4] reduce(%a), metadata={op_name="jit(run_step)/sampling/argmax"}
  %add.7 = f32[4,8] add(%a, %a), metadata={op_name="jit(run_step)/jit(decoder_layer)/add"}
}
'''


def test_each_instruction_gets_its_kind():
    kinds = sp.instruction_kinds(HLO)
    assert kinds["dot_fusion"] == "matmul"  # a dot inside the fused computation
    assert kinds["loop_fusion"] == "norm"  # its named scope
    assert kinds["custom-call.3"] == "attention"  # the kernel it calls
    assert kinds["argmax"] == "sampling" and kinds["add.7"] == "other"


def test_busy_time_is_the_union_of_intervals():
    assert sp._union([(0, 10), (5, 15), (20, 25)]) == 20
    events = [dict(name="dot_fusion", ts=0, dur=10), dict(name="end: loop_fusion", ts=5, dur=10),
              dict(name="not_ours", ts=30, dur=100)]
    att = sp.attribute(events, {"m": sp.instruction_kinds(HLO)})
    assert att["us_by_kind"] == {"matmul": 10, "norm": 10} and att["busy_us"] == 15


def test_no_dumped_program_is_an_error_not_an_empty_profile():
    """Flags set after the backend started dump nothing: that must not read as 0 ms."""
    with pytest.raises(RuntimeError, match="dumped no programs"):
        sp.attribute([dict(name="dot_fusion", ts=0, dur=10)], {})


@pytest.mark.slow
def test_a_quick_profile_splits_real_steps(tmp_path):
    """In its own process, as a user runs it: this suite's processes compile other engines'
    programs (same thunk names) and set XLA flags of their own."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PAGED_JAX_RESULTS=str(tmp_path))  # not the committed results
    env.pop("XLA_FLAGS", None)
    subprocess.run([sys.executable, "-m", "experiments.step_profile", "--quick"], env=env,
                   check=True, timeout=600)
    data = json.loads((tmp_path / "step_profile.json").read_text())
    decode = [r for r in data["rows"] if r["phase"] == "decode"]
    assert [r["batch"] for r in decode] == [1, 4]
    for r in decode:
        assert r["steps"] >= 4 and 0 < r["device_busy_ms"] <= r["step_ms"]
        assert {"matmul", "attention", "sampling"} <= set(r["ms_by_kind"])
        assert 0.3 < r["share_by_kind"]["matmul"] < 1
