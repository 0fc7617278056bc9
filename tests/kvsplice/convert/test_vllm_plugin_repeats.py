"""benchmarks/engines_vllm_plugin.py ``--repeats``: each ratio's median and spread over the runs, at the median decode
step and over all decode steps, the load average sampled during each run, the rows of the median run (through
``--join``: the runner's files, no vLLM needed), and a bad count refused in one line before vLLM is looked for."""

from __future__ import annotations

import json
import time

import pytest

from benchmarks.lib import engines as lib
from tiny_models import load_benchmark

MHA, KV90 = "ds_mha (124M shapes, random)", "ds_mla_kvsplice_90 (124M shapes, random)"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("engines_vllm_plugin")


def run_of(mha: tuple[float, float], kv90: tuple[float, float], load: float) -> dict:
    """One run's rows: (median-step, all-steps) decode tok/s of standard attention and KVSplice-90."""
    def row(model, rates, plugin=True):
        return dict(model=model, plugin=plugin, backend="CPU_MLA", decode_kernel="torch", row=42, bytes_per_token=2016,
                    bytes_per_token_formula=2016, cache_tokens_vllm=4672, cache_tokens_formula=4681, greedy_equal=True,
                    max_abs_logprob_diff=1e-6, kv_budget=80216064,
                    throughput=dict(seqs=38, max_batch=30, median_decode_tok_s=rates[0], decode_tok_s=rates[1],
                                    prefill_seconds=3.0, prompt=1008, new=16))

    return dict(rows=[row(MHA, mha), row(KV90, kv90)], load=dict(mean=load, min=load, max=load + 1, n=3))


def report(bench, tmp_path, runs: list[dict], name: str = "o") -> tuple[dict, str]:
    """The runner's JSON and Markdown for ``runs`` written as one results file of this study and joined."""
    rows = [dict(r, run=i, load=u["load"], vllm="0.32.0") for i, u in enumerate(runs) for r in u["rows"]]
    (tmp_path / f"{name}_in.json").write_text(json.dumps(dict(study="engines_vllm_plugin", rows=rows)))
    assert bench.main(["--join", str(tmp_path / f"{name}_in.json"), "--out", str(tmp_path / name)]) == 0
    res = json.loads((tmp_path / f"{name}.json").read_text())
    return res, (tmp_path / f"{name}.md").read_text()


def test_repeats_give_median_and_spread_of_each_ratio(bench, tmp_path):
    runs = [run_of((50, 40), (500, 300), 1.0), run_of((25, 20), (400, 200), 3.0), run_of((40, 40), (360, 280), 2.0)]
    (s,) = lib.repeat_summary(runs)
    assert s["ratio"] == f"{KV90} vs standard attention"
    assert s["median_step"]["values"] == [10, 16, 9] and s["median_step"]["median"] == 10
    assert (s["median_step"]["min"], s["median_step"]["max"]) == (9, 16)
    assert s["all_steps"]["values"] == [7.5, 10, 7] and s["all_steps"]["median"] == 7.5
    assert [x["mean"] for x in s["load"]] == [1.0, 3.0, 2.0]
    res, md = report(bench, tmp_path, runs)
    assert res["table"] == [0, 1] and res["ratios"] == {s["ratio"]: 10}  # the run at the median
    assert len(res["rows"]) == 6 and res["repeats"][0]["median_step"]["median"] == 10
    assert "| 3 | 10.00× (9.00–16.00) | 7.50× (7.00–10.00) | 10.00 / 7.50, 16.00 / 10.00, 9.00 / 7.00 |" in md
    assert "1.0 (2.0), 3.0 (4.0), 2.0 (3.0)" in md and "vLLM 0.32.0" in md
    one, md = report(bench, tmp_path, runs[:1], "one")  # one run: no repeat section
    assert one["repeats"] == [] and "Repeated runs" not in md


def test_a_run_cut_short_counts_where_it_measured(bench, tmp_path):
    """The last run stopped after standard attention: KVSplice-90's ratio is over the two runs that have it."""
    runs = [run_of((50, 40), (500, 300), 1.0), run_of((25, 20), (400, 200), 3.0), run_of((40, 40), (0, 0), 2.0)]
    runs[2]["rows"] = runs[2]["rows"][:1]
    res, _ = report(bench, tmp_path, runs)
    (s,) = res["repeats"]
    assert s["runs"] == [0, 1] and s["median_step"]["values"] == [10, 16] and s["median_step"]["median"] == 13
    assert [x["mean"] for x in s["load"]] == [1.0, 3.0] and res["table"] == [0, 1]  # 10 and 16 both 3 from 13: the earlier


def test_join_keeps_the_repeats(bench, tmp_path):
    """Files written before the runner (``runs``: every run's rows and load; ``rows``: the median run's) join as
    parts: each part's median run in the table, each part's repeats."""
    runs = [run_of((50, 40), (500, 300), 1.0), run_of((25, 20), (400, 200), 3.0), run_of((40, 40), (360, 280), 2.0)]
    (tmp_path / "a.json").write_text(json.dumps(dict(command="a", machine="m", vllm="0.32.0", rows=runs[1]["rows"],
                                                     runs=runs, repeats=[])))  # recomputed on joining
    tiny = dict(command="t", machine="m", vllm="0.32.0", rows=[dict(run_of((2, 2), (500, 480), 5.0)["rows"][1],
                                                                    model="ds_mla_kvsplice_90 (tiny, 20 steps)")])
    (tmp_path / "t.json").write_text(json.dumps(tiny))
    assert bench.main(["--join", str(tmp_path / "a.json"), str(tmp_path / "t.json"), "--out", str(tmp_path / "j")]) == 0
    joined = json.loads((tmp_path / "j.json").read_text())
    assert len(joined["rows"]) == 7 and joined["repeats"][0]["median_step"]["median"] == 10
    assert [joined["rows"][i]["model"] for i in joined["table"]] == [MHA, KV90, tiny["rows"][0]["model"]]
    assert joined["table"][:2] == [0, 1]
    assert "Repeated runs" in (tmp_path / "j.md").read_text()


def test_load_sampler_samples_while_running(bench):
    with lib.sampled_load(every=0.05) as s:
        time.sleep(0.3)
        assert s == {}  # filled when the block ends
    assert s["n"] >= 4 and s["min"] <= s["mean"] <= s["max"]


@pytest.mark.parametrize("n", ["0", "21", "-1"])
def test_bad_repeat_count_is_one_line(bench, tmp_path, capsys, n):
    assert bench.main(["--out", str(tmp_path / "o"), "--repeats", n]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"engines_vllm_plugin: error: --repeats: must be in [1, 20], got {n}", err
    assert not list(tmp_path.iterdir())


def test_readme_and_docs_quote_the_committed_repeats():
    """README.md and docs/vllm.md give the committed KVSplice-90 / standard-attention ratio as its median and spread
    over repeated runs (median decode step and all decode steps), beside the seed's 18× claim."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    res = json.loads((root / "results" / "engines_vllm_plugin.json").read_text(encoding="utf-8"))
    rep = next(r for r in res["repeats"] if r["ratio"] == f"{KV90} vs standard attention")
    m, a = rep["median_step"], rep["all_steps"]
    assert m["n"] >= 2 and len(res["runs"]) == m["n"]
    quoted = [f"{x['median']:.1f}× ({x['min']:.1f}–{x['max']:.1f}" for x in (m, a)]
    for doc in ("README.md", "docs/vllm.md"):
        text = " ".join((root / doc).read_text(encoding="utf-8").split())  # line breaks as spaces
        assert all(q in text for q in quoted) and "18×" in text, (doc, quoted)
