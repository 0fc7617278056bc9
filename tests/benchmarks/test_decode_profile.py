"""benchmarks/decode_profile.py on small shapes: the per-layer rows (SDPA, coded_attend and its parts) and the
per-step op groups of a tiny model, written as json + md. No timing assertions: only that the real paths run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import load_benchmark, tiny_family  # noqa: E402


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
    bench.write({"command": "test", "machine": "test", "layer": layer, "step": step}, tmp_path / "dp")
    assert json.loads((tmp_path / "dp.json").read_text())["layer"] == layer
    assert "| 256 | full cache: SDPA" in (tmp_path / "dp.md").read_text()


def test_fused_formulation_equals_coded_attend_parts() -> None:
    """The fused (compile-able) KIVI formulation computes the same scores and weighted sum as the coded parts."""
    bench = _bench()
    cache, k, v, q = bench.kivi_layer(256)  # 128 quantised + the 128-token window
    segs = cache.append_segments(0, k[:, :, -1:], v[:, :, -1:])
    keys, vals = segs[0].keys, segs[0].values
    rows_q = q.reshape(1, bench.HKV, bench.HQ // bench.HKV, bench.D) * 0.125
    s = keys.scores(rows_q)
    assert torch.allclose(bench._scores_fused(rows_q, keys.data, keys.scale, keys.mn), s, atol=1e-4)
    p = torch.softmax(s, -1)
    assert torch.allclose(bench._weighted_fused(p, vals.data, vals.scale, vals.mn), vals.weighted(p), atol=1e-4)
