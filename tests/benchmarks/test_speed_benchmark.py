"""CPU smoke test of benchmarks/smollm2_speed.py on a tiny model: every default method family (the full cache,
int8, KIVI-4, k8v4h, the planner's picks' KVzip stacks) prefilled and decoded round-robin in both doors, batch 1
and 2, the report written (json, md, png). No timing assertions: only that the real paths run and report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import load_benchmark, tiny_family  # noqa: E402
from test_kvzip import _ids, _Tok  # noqa: E402

from kvsplice.core.build import build_method  # noqa: E402
from benchmarks.harness import report, studies  # noqa: E402
from benchmarks.lib.speed import interleaved, measure, method_factories, peak_rss  # noqa: E402


def _bench():
    return load_benchmark("smollm2_speed")


@pytest.mark.parametrize("batch", [1, 2])
def test_speed_benchmark_runs_every_method_in_both_doors(tmp_path, batch) -> None:
    bench = _bench()
    model = tiny_family("llama", n_layer=3)
    tok = _Tok(_ids(5, 3))
    ids = torch.cat([_ids(6 + i, 40) for i in range(batch)])  # (B, 40)
    methods = [("full", None), ("int8", build_method("int8")), ("kivi4", build_method("kivi4(group=8,residual=16)")),
               ("k8v4h", build_method("k8v4h"))]
    for name in ("pick4x", "pick8x"):
        spec = bench.PICKS[name]
        methods.append((name, lambda x, spec=spec: build_method(spec, prompt_len=x.shape[1], prompt_ids=x,
                                                                tokenizer=tok)))
    rows = []
    for door in ("hf", "decoder"):
        got = measure(model, door, methods, ids, rounds=2)
        assert [r["method"] for r in got] == [m for m, _ in methods]
        assert got[0]["decode_vs_full"] == 1.0 and all(r["steps"] == 2 and r["decode_ms"] > 0 for r in got)
        assert all(r["cache_bytes"] > 0 and r["batch"] == batch and r["context"] == 40 for r in got)
        assert got[2]["cache_bytes"] < got[0]["cache_bytes"]  # KIVI holds fewer bytes than the full cache
        rows += [{**r, "dtype": "fp32"} for r in got]
    assert len(rows) == 2 * len(methods)
    assert "| fp32 | 40 |" in report.markdown(studies.load("smollm2_speed")["report"], rows)
    fig = report.figure(studies.load("smollm2_speed")["figure"], rows)
    assert len(fig.axes) == 2  # one panel per (dtype, door, batch)


def test_method_factories_build_the_studys_methods() -> None:
    """``--methods``' names as the study builds them: the full cache, a spec, a pick's KVzip stack per prompt (with
    ``--pick-scores random``: random token scores, no reconstruction pass)."""
    import types

    model, tok = tiny_family("llama", n_layer=3), _Tok(_ids(5, 3))
    args = types.SimpleNamespace(methods=["full", "int8", "pick4x"], plan4=None, plan8=None, pick_scores="random")
    got = method_factories(args, model, tok, _bench().PICKS)
    assert [m for m, _ in got] == ["full", "int8", "pick4x"] and got[0][1] is None and hasattr(got[1][1], "attend")
    ids = _ids(6, 40)
    pick = got[2][1](ids)
    assert set(pick.shared_scores) == set(range(3)) and pick.shared_scores[0].shape[-1] == 40
    rows = measure(model, "decoder", got, ids, rounds=1)
    assert [r["method"] for r in rows] == ["full", "int8", "pick4x"] and rows[2]["cache_bytes"] < rows[0]["cache_bytes"]


def test_quick_size_and_peak_rss(tmp_path, monkeypatch, capsys) -> None:
    """``--quick`` is the study's quick size: 512 tokens and 4 rounds (+ 2 steps) reach the check on positions."""
    import types

    import kvsplice.loading as loading

    model = tiny_family("llama", n_layer=1)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: types.SimpleNamespace(model=model, tokenizer=None))
    assert _bench().main(["--quick", "--out", str(tmp_path / "q")]) == 2
    assert "--contexts [512] + 6 decode steps exceed" in capsys.readouterr().err
    assert _bench().STUDY.size_table()["quick"] == {"contexts": [512], "batch": [1, 2], "rounds": 4}
    with peak_rss() as rss:
        x = torch.ones(4 << 20)  # 16 MiB held while sampled
        x += 1
    assert rss["peak"] >= rss["start"] and rss["grown"] == rss["peak"] - rss["start"] >= 0


def test_contexts_past_the_models_positions_are_refused_before_any_work(tmp_path, monkeypatch, capsys) -> None:
    """--contexts whose decode steps pass the model's positions stop at once in one line, nothing written."""
    import types

    import kvsplice.loading as loading

    model = tiny_family("llama", n_layer=1)
    limit = model.config.max_position_embeddings
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: types.SimpleNamespace(model=model, tokenizer=None))
    assert _bench().main(["--contexts", "16", str(limit), "--rounds", "2", "--out", str(tmp_path / "s")]) == 2
    assert f"exceed the model's {limit} positions" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_interleaved_runs_the_names_in_turn_and_takes_each_timings_median() -> None:
    calls = []

    def one(name):
        calls.append(name)
        return len(calls), -len(calls)

    runs, med = interleaved(["a", "b"], 3, one)
    assert calls == ["a", "b"] * 3  # every repeat runs each name once, in turn
    assert runs == {"a": [(1, -1), (3, -3), (5, -5)], "b": [(2, -2), (4, -4), (6, -6)]}
    assert med == {"a": [3, -3], "b": [4, -4]}
