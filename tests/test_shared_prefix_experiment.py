"""experiments/shared_prefix.py at a tiny scale: it runs, caching hits, JSON + PNG are written."""

from __future__ import annotations

import json

import pytest

from experiments import common, shared_prefix


@pytest.fixture(autouse=True)
def tmp_results(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    return tmp_path


def test_shared_prefix_smoke():
    payload = shared_prefix.main(requests=4, convs=2, turns=2, orca=False)
    assert open(payload["png"], "rb").read(4) == b"\x89PNG"
    data = json.loads(open(payload["json"]).read())
    rows = {(r["workload"], r["run"]): r for r in data["rows"]}
    for wl in ("1-shot", "5-shot", "chat 2x2"):
        on, off = rows[(wl, "caching on")], rows[(wl, "caching off")]
        assert on["hit_rate"] > 0 and on["blocks_saved"] > 0, wl
        assert off["hit_rate"] == 0 and off["output_tokens"] == on["output_tokens"], wl
