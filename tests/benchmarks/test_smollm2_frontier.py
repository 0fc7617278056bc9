"""benchmarks/smollm2_frontier.py on the runner: a resumed run with ``--only`` and no id measures nothing and renders
the committed rows into the same tables as the committed report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tiny_models import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_the_report_is_rendered_from_the_resumed_rows_alone(tmp_path, monkeypatch):
    import benchmarks.lib.smollm2_frontier_runs as runs

    monkeypatch.setattr(runs, "Bench", None)  # measuring a row would fail: none is measured
    bench = load_benchmark("smollm2_frontier")
    shutil.copy(ROOT / "results" / "smollm2_frontier.json", tmp_path / "f.json")
    assert bench.main(["--out", str(tmp_path / "f"), "--resume", "--force", "--only", "--threads", "1"]) == 0
    old, new = json.loads((ROOT / "results" / "smollm2_frontier.json").read_text()), \
        json.loads((tmp_path / "f.json").read_text())
    assert new["rows"] == old["rows"] and new["kvpress_quoted"] == old["kvpress_quoted"]
    md = (tmp_path / "f.md").read_text().splitlines()
    table = [line for line in md if line.startswith(("| ★ |", "|  | ")) and "method / stack" not in line]
    assert len(table) == sum(r["protocol"] == "P" for r in old["rows"])
    committed = set((ROOT / "results" / "smollm2_frontier.md").read_text().splitlines())
    assert set(table) <= committed  # the numbers of every table (P, W, S, the planner's, the energy ranks) as then
    assert {line for line in md if line.startswith("| ") and "---" not in line} - committed == {
        "|  | method / stack | ppl | Δ % | bytes / token | × smaller than fp16 full |",
        "| selector | ratio | ppl | Δ % | kvpress's best press at this ratio (kvpress 0.5.5, quoted) |"}
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_the_rows_are_study_data_each_measurable_once():
    """The rows (``benchmarks/studies/smollm2_frontier.yaml``): unique ids, one protocol each, and every spec of a
    kind the bench measures; the committed results hold a row for every one of them."""
    bench = load_benchmark("smollm2_frontier")
    rows = bench.ROWS
    ids = [rid for rid, _, _ in rows]
    assert len(ids) == len(set(ids)) and {p for _, p, _ in rows} == {"P", "S", "W"}
    known = {"store", "selector", "x", "bits", "residual", "alloc", "rope", "method", "rank", "cache_quant", "plan",
             "hf_quant", "nbits"}
    assert all(set(spec) <= known for _, _, spec in rows)
    assert all(spec.get("store", "dense") in ("dense", "int8", "kivi", "lowrank", "joint") for _, _, spec in rows)
    assert all("method" not in spec for _, _, spec in rows if "alloc" in spec)  # allocated ranks: Fisher's only
    committed = {r["id"] for r in json.loads((ROOT / "results" / "smollm2_frontier.json").read_text())["rows"]}
    assert set(ids) - committed <= {"hf_quanto_int4", "hf_quanto_int2"}  # skipped without optimum-quanto


def test_method_family_of_a_row():
    """One classification serves the frontier figure and the front page: by id for plans and low rank (joint
    latents included), by label for token selections with or without a quantised store."""
    from benchmarks.harness.studies import load
    from benchmarks.smollm2_frontier import family

    cases = {("full", "full K/V"): "full", ("plan_4x", "observed_attention×2.1 + int8"): "planner",
             ("joint_fisher_pre_x2", "joint fisher pre-RoPE allocated ×2"): "low rank (bases)",
             ("lr_kq_pre_r32", "lowrank gqa-concat pre-RoPE r32"): "low rank (bases)",
             ("obs_x4_int8", "observed_attention×4 + int8"): "token selection + quantisation",
             ("obs_x1.55_kivi4_r32", "observed_attention×1.55 + kivi4(g32,r32)"): "token selection + quantisation",
             ("snapkv_x8", "snapkv×8 + fp"): "token selection alone",
             ("kivi2_r32", "kivi2(g32,r32)"): "quantisation", ("hf_fp8", "transformers QuantizedCache(fp8)"):
             "quantisation"}
    for (rid, label), fam in cases.items():
        assert family({"id": rid, "label": label}) == fam, rid
    assert set(cases.values()) == set(load("smollm2_frontier")["figure"]["markers"])  # a marker each


def test_a_plan_row_searches_with_the_planners_options(monkeypatch):
    """A ``plan`` row (``Bench.plan``) runs the planner's search as the package declares it now (its options, the
    perplexity objective over the attention selectors) and returns its pick and evidence: here on a tiny Llama."""
    import torch
    from tiny_models import tiny_family

    import benchmarks.lib.smollm2_frontier_runs as runs
    from kvsplice.lowrank.sensitivity import stats_for

    bench = runs.Bench.__new__(runs.Bench)  # (no SmolLM2: the model, statistics and tuning slice set here)
    bench.model = tiny_family("llama", n_layer=2)
    bench.tune = torch.randint(3, 96, (2, 48), generator=torch.Generator().manual_seed(0))
    bench.stats = stats_for(bench.model, lambda: list(bench.tune.split(1)), progress=False)[0]
    monkeypatch.setattr(runs, "PROMPT", 32)
    best, evidence = bench.plan(2.0)
    assert evidence["selector"] in ("snapkv", "observed_attention") and evidence["candidates"]
    assert best["name"] and evidence["tuning_full_ppl"] > 1
