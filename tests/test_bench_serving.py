"""experiments/bench_serving against an in-process server on the tiny model: every request is
accounted for (done, 503 or failed; none lost), and the latency statistics are filled in."""

from __future__ import annotations

import json

import pytest

from experiments import bench_serving
from tests.serve_helpers import MODEL, serve

pytestmark = pytest.mark.xdist_group("serve")


def test_bench_serving_accounts_for_every_request(tmp_path, monkeypatch):
    monkeypatch.setattr("experiments.common.RESULTS", tmp_path)
    with serve(max_pending=6) as srv:
        out = bench_serving.main(["--url", srv.url, "--served-model-name", MODEL, "--bytes",
                                  "--requests", "10", "--rates", "100", "inf", "--scale", "0.05",
                                  "--timeout", "120"], name="bench")
    for row in out["rows"]:
        assert row["sent"] == 10 and row["lost"] == 0 and row["failed"] == 0
        assert row["done"] + row["refused_503"] == 10 and row["done"] >= 6
        assert row["ttft_p50_ms"] > 0 and row["output_tok_s"] > 0
    assert any(r["refused_503"] for r in out["rows"]), "10 at once past max_pending=6: some 503"
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(out["rows"]))
