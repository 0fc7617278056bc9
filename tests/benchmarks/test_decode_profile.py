"""benchmarks/decode_profile.py on small shapes: the per-layer rows (SDPA, coded_attend and its parts) and the
per-step op groups of a tiny model, written as json + md. No timing assertions: only that the real paths run."""

from __future__ import annotations

import json

import torch

from benchmarks.harness import report, studies
from tiny_models import load_benchmark, tiny_family


def _bench():
    return load_benchmark("decode_profile")


def test_decode_profile_layer_and_step_rows(tmp_path) -> None:
    bench = _bench()
    layer = bench.layer_rows(256, compile_=False)
    ops = [r["op"] for r in layer]
    assert ops[0].startswith("full cache: SDPA") and any(o.startswith("kivi4: coded_attend") for o in ops)
    assert sum("conversion to" in o for o in ops) == 2 and all(r["us"] > 0 and r["context"] == 256 for r in layer)
    model = tiny_family("llama", n_layer=2)
    step = bench.step_rows(model, 48, spec="kivi4(group=8,residual=16)")
    assert {r["method"] for r in step} == {"full", "kivi4(group=8,residual=16)"}
    assert {r["group"] for r in step} >= {"SDPA", "everything else"} and sum(r["ms"] for r in step) > 0
    rows = [{"view": "layer", **r} for r in layer] + [{"view": "step", **r} for r in step]
    md = report.markdown(studies.load("decode_profile")["report"], rows)
    assert "| 256 | full cache: SDPA" in md and "| 48 | full | SDPA |" in md


def test_decode_profile_runs_on_the_runner(tmp_path) -> None:
    """The study end to end at its smallest context, the per-layer view only: JSON rows and the report."""
    bench = _bench()
    assert bench.main(["--no-model", "--contexts", "160", "--out", str(tmp_path / "dp")]) == 0
    data = json.loads((tmp_path / "dp.json").read_text())
    assert data["complete"] and {r["view"] for r in data["rows"]} == {"layer"}
    assert all(r["context"] == 160 and r["us"] > 0 for r in data["rows"])
    assert "| 160 | full cache: SDPA" in (tmp_path / "dp.md").read_text()
    assert bench.main(["--no-model", "--contexts", "100", "--out", str(tmp_path / "dp2")]) == 2  # below the window


def test_fused_formulation_equals_coded_attend_parts() -> None:
    """The fused (compile-able) KIVI formulation computes the same scores and weighted sum as the coded parts."""
    bench = _bench()
    cache, k, v, q = bench.kivi_layer(256)  # 128 quantised + the 128-token window
    segs = cache.append_segments(0, k[:, :, -1:], v[:, :, -1:])
    keys, vals = segs[0].keys, segs[0].values
    rows_q = q.reshape(1, bench.HKV, bench.HQ // bench.HKV, bench.D) * 0.125
    s = keys.scores(rows_q)
    assert torch.allclose(bench.scores_fused(rows_q, keys.data, keys.scale, keys.mn), s, atol=1e-4)
    p = torch.softmax(s, -1)
    assert torch.allclose(bench.weighted_fused(p, vals.data, vals.scale, vals.mn), vals.weighted(p), atol=1e-4)
