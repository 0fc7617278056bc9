"""``fit_bases`` fits every (method, RoPE mode, rank) from one calibration pass, reuses saved statistics, allocates
ranks by the predicted loss; ``eval_bases`` without ``--diagnostics`` reports perplexity, bytes and its decode time
over a plain forward; every CLI refuses a device that is not there with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hostile import s260k  # noqa: F401  (s260k: a fixture)
from kvsplice.cli import eval_bases, fit_bases, generate, to_mla
from kvsplice.lowrank.bases import KVBases

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
STORIES = DATA / "stories260K"
CALIB = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"
EVAL = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"
pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file() or not CALIB.is_file(),
                                reason=f"stories260K / TinyStories not found under {DATA}")
SMALL = ["--calib", str(CALIB), "--calib-tokens", "2048", "--seq-len", "256", "--no-progress"]


def test_six_methods_three_ranks_two_rope_modes_from_one_pass(s260k, tmp_path, capsys, monkeypatch):
    import kvsplice.lowrank.sensitivity as sens

    passes = []
    real = sens.calibrate_all
    monkeypatch.setattr(sens, "calibrate_all", lambda *a, **k: passes.append(1) or real(*a, **k))
    stats = tmp_path / "stats.safetensors"
    args = ["--model", str(s260k), *SMALL, "--calib-stats", str(stats), "--method", "ksvd", "eigen", "kq", "gqa-sum",
            "gqa-concat", "fisher", "--rank", "2", "4", "6", "--rope", "pre", "post", "--out",
            str(tmp_path / "b_{method}_{rope}_r{rank}.safetensors"), "--json", str(tmp_path / "fit.json")]
    assert fit_bases.main(args) == 0
    assert passes == [1] and stats.is_file()
    files = sorted(tmp_path.glob("b_*.safetensors"))
    assert len(files) == 36
    b = KVBases.load(tmp_path / "b_fisher_pre_r4.safetensors")
    assert b.method == "fisher" and b.rope == "pre" and b.ranks()["k"][0] == [4] * 4
    out = capsys.readouterr().out
    assert "36 bases from one calibration pass" in out
    # reuse: another method/allocation from the saved stats, no pass at all
    assert fit_bases.main(["--model", str(s260k), *SMALL, "--calib-stats", str(stats), "--method", "fisher",
                           "--alloc-ratio", "2", "--rope", "pre", "--out", str(tmp_path / "alloc.safetensors"),
                           "--json", str(tmp_path / "alloc.json")]) == 0
    assert passes == [1]
    rep = json.loads((tmp_path / "alloc.json").read_text())
    assert rep["calibration"]["reused_stats"] and rep["elements_per_token"] == 2 * 5 * 4 * 8 // 2
    assert rep["allocation"]["mean_rank_k"] + rep["allocation"]["mean_rank_v"] == pytest.approx(8)
    # a pattern is required for several outputs
    capsys.readouterr()
    assert fit_bases.main(["--model", str(s260k), *SMALL, "--method", "kq", "fisher", "--rank", "2", "--out",
                           str(tmp_path / "one.safetensors")]) == 2
    assert "{method}" in capsys.readouterr().err


def test_eval_without_diagnostics_reports_time_over_a_plain_forward(s260k, tmp_path, capsys):
    bases = tmp_path / "b.safetensors"
    assert fit_bases.main(["--model", str(s260k), *SMALL, "--method", "kq", "--rank", "4", "--out", str(bases)]) == 0
    rep = tmp_path / "e.json"
    capsys.readouterr()
    assert eval_bases.main(["--model", str(s260k), "--bases", str(bases), "--data", str(EVAL), "--tokens", "1024",
                            "--seq-len", "256", "--no-progress", "--json", str(rep)]) == 0
    out = capsys.readouterr().out
    r = json.loads(rep.read_text())["results"][0]
    assert "layers" not in r and "diagnostics" not in r and r["decode_over_forward"] > 0
    assert "plain forward" in out and "per-layer errors" not in out


@pytest.mark.parametrize("cli,args", [
    (fit_bases, ["--method", "kq", "--rank", "2", *SMALL, "--out", "x.safetensors"]),
    (eval_bases, ["--bases", "x.safetensors", "--data", str(EVAL)]),
    (generate, ["--prompt", "Hi", "--max-new-tokens", "2"]),
])
def test_a_missing_device_is_one_line(s260k, tmp_path, capsys, cli, args, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if cli is eval_bases:
        fit_bases.main(["--model", str(s260k), "--method", "kq", "--rank", "2", *SMALL, "--out", "x.safetensors"])
    capsys.readouterr()
    assert cli.main(["--model", str(s260k), *args, "--device", "cuda:7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda:7" in err[0], err


def test_to_mla_takes_a_device(capsys):
    assert to_mla.main(["--model", "nope.ckpt", "--d-latent", "4", "--out", "o.ckpt", "--device", "cpu"]) == 2
    assert "nope.ckpt" in capsys.readouterr().err  # the device option parses; the missing model is the error
