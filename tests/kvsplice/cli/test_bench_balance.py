"""The single-layer BalanceKV experiment (kvsplice.bench_balance): the plan keeps what it says, the error is the
estimator's, T = 0 is exact, the CLI writes JSON + PNG with the documented structure, bad inputs fail in one line."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from kvsplice.cli.bench_balance import ARMS, keep_plan, layer_errors, main, make_arm

REPO = Path(__file__).resolve().parents[3]
DATA = REPO.parent / "shared" / "data"
STORIES = DATA / "stories260K"
TEXT = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"
GPT2_TOK = DATA / "gpt2_tokenizer"
needs_data = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file() or not TEXT.is_file(),
                                reason=f"shared data folder absent ({DATA})")




# ------------------------------------------------------------------------------------------------ unit
@pytest.mark.parametrize("T", [0, 1, 2, 3])
def test_plan_keeps_the_same_intact_tokens_for_every_method(T):
    c, s, r = 150, 4, 16
    plan = keep_plan(c, T, s, r)
    m = c - s - r
    assert plan["middle"] == m - m % 2 ** T and plan["middle_kept"] == plan["middle"] // 2 ** T
    assert plan["budget"] == s + r + m % 2 ** T + plan["middle_kept"]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, c, 8, generator=g), torch.randn(3, c, 8, generator=g)
    intact = set(range(s)) | set(range(s + plan["middle"], c))
    for name in ARMS:
        idx, logw = make_arm(name, plan, block_size=16, seed=1).select(k, v, plan["budget"])
        assert idx.shape == (3, plan["budget"])
        for h in range(3):
            kept = dict(zip(idx[h].tolist(), logw[h].tolist()))
            assert intact <= set(kept)
            for i, w in kept.items():
                expect = 0.0 if (i in intact or T == 0) else T * math.log(2)
                assert abs(w - expect) < 1e-6, (name, i, w)


def test_plans_of_one_run_share_their_intact_tokens():
    plans = [keep_plan(150, T, 4, 16, t_max=4) for T in range(5)]
    assert len({(p["sinks"], p["recent_intact"], p["middle"]) for p in plans}) == 1
    assert plans[0]["middle"] % 16 == 0 and plans[0]["budget"] == 150
    assert [p["middle_kept"] for p in plans] == [plans[0]["middle"] // 2 ** T for T in range(5)]


def test_layer_errors_is_the_weighted_estimator_and_zero_without_compression():
    g = torch.Generator().manual_seed(2)
    b, hkv, gq, n, c, d = 2, 2, 2, 3, 60, 4
    q = torch.randn(b, hkv * gq, n, d, generator=g)
    k, v = torch.randn(b, hkv, c, d, generator=g), torch.randn(b, hkv, c, d, generator=g)
    plan0 = keep_plan(c, 0, 2, 4)
    assert layer_errors(q, k, v, 0.5, make_arm("balancekv", plan0), plan0["budget"])[0] < 1e-12
    plan = keep_plan(c, 2, 2, 4)
    sel = make_arm("uniform", plan, seed=3)
    rel, rel_q = layer_errors(q, k, v, 0.5, sel, plan["budget"])
    sel.reseed(3)
    idx, logw = sel.select(k.reshape(b * hkv, c, d), v.reshape(b * hkv, c, d), plan["budget"])
    num = den = 0.0
    per_q = []
    for i in range(b):
        for h in range(hkv * gq):
            j = i * hkv + h // gq
            kk, vv = k[i, h // gq].double(), v[i, h // gq].double()
            for t in range(n):
                a = torch.softmax(kk @ q[i, h, t].double() * 0.5, 0) @ vv
                w = torch.exp(logw[j].double() + kk[idx[j]] @ q[i, h, t].double() * 0.5)
                z = (w @ vv[idx[j]]) / w.sum()
                num += (z - a).pow(2).sum().item()
                den += a.pow(2).sum().item()
                per_q.append(((z - a).norm() / a.norm()).item())
    assert abs(rel - math.sqrt(num / den)) < 1e-9
    assert abs(rel_q - sum(per_q) / len(per_q)) < 1e-9


# ------------------------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def stories_dir(tmp_path_factory):
    if not (STORIES / "stories260K.bin").is_file():
        pytest.skip(f"shared data folder absent ({DATA})")
    from kvsplice.convert.llama2c import convert_llama2c

    return convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin",
                           tmp_path_factory.mktemp("bb") / "stories260K-hf")


def _check_report(path: Path, layers, Ts, seeds):
    rep = json.loads(path.read_text())
    png = path.with_suffix(".png")
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rep["config"]["layers"] == layers and rep["config"]["T"] == Ts and rep["config"]["seeds"] == seeds
    assert "median" in rep["config"]["threshold"]
    assert len(rep["rows"]) == len(layers) * len(Ts) * len(ARMS)
    assert [p["T"] for p in rep["plans"]] == Ts
    for row in rep["rows"]:
        assert set(row) >= {"layer", "T", "method", "budget", "mean", "std", "rel_q_mean", "per_seed"}
        assert len(row["per_seed"]) == seeds
        if row["T"] == 0:
            assert row["mean"] < 1e-10 and row["budget"] == rep["config"]["compressed_context"]
        else:
            assert 0 < row["mean"] < 10 and math.isfinite(row["std"])
    assert "vs_uniform" in rep["verdict"] and "vs_coinflip" in rep["verdict"]
    return rep


@needs_data
def test_cli_on_stories260k(stories_dir, tmp_path, capsys):
    out = tmp_path / "res" / "bb.json"
    rc = main(["--model", str(stories_dir), "--data", str(TEXT), "--layers", "0", "4", "--T", "0", "1", "2",
               "--seeds", "2", "--windows", "2", "--context", "160", "--n-queries", "16", "--block-size", "32",
               "--markdown", "--json", str(out)])
    assert rc == 0
    rep = _check_report(out, [0, 4], [0, 1, 2], 2)
    assert rep["config"]["family"] == "llama" and rep["config"]["keys"] == "post-RoPE"
    assert rep["config"]["compressed_context"] == 144 and rep["config"]["windows"] == 2
    printed = capsys.readouterr().out
    assert "| layer | T |" in printed and "wrote" in printed


@pytest.mark.skipif(not (GPT2_TOK / "encoder.json").is_file() or not TEXT.is_file(), reason="shared data absent")
def test_cli_on_a_tiny_gpt2(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=128, n_embd=32, n_layer=2, n_head=4)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "g.json"
    rc = main(["--model", str(tmp_path / "gpt2"), "--tokenizer", str(GPT2_TOK), "--data", str(TEXT), "--T", "0", "1",
               "--seeds", "2", "--windows", "1", "--context", "96", "--n-queries", "8", "--block-size", "16",
               "--json", str(out)])
    assert rc == 0
    rep = _check_report(out, [0, 1], [0, 1], 2)
    assert rep["config"]["family"] == "gpt2"


@needs_data  # the model check comes after the --data check: needs a real text file
def test_bad_paths_fail_with_one_line(tmp_path, capsys):
    rc = main(["--model", str(tmp_path / "nope"), "--data", str(TEXT)])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and err.startswith("kvsplice bench-balance: error:") and "\n" not in err
    (tmp_path / "empty").mkdir()
    rc = main(["--model", str(tmp_path / "empty"), "--data", str(TEXT)])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "config.json" in err and "\n" not in err


@needs_data
def test_bad_data_and_args_fail_with_one_line(stories_dir, tmp_path, capsys):
    for extra, what in ((["--data", str(tmp_path / "missing.txt")], "not found"),
                        (["--data", str(TEXT), "--context", "4096"], "positions"),
                        (["--data", str(TEXT), "--layers", "7"], "out of range")):
        rc = main(["--model", str(stories_dir), *extra, "--seeds", "1"])
        err = capsys.readouterr().err.strip()
        assert rc != 0 and err.startswith("kvsplice bench-balance: error:") and what in err and "\n" not in err, err


@pytest.mark.parametrize("threads,what", [("0", "must be >= 1"), ("-2", "must be >= 1"), ("100000", "CPUs")])
def test_bad_thread_counts_are_refused_in_one_line(threads, what, capsys):
    """``--threads 0`` ran with one thread without a word; 100000 asked torch for that many."""
    try:
        rc = main(["--model", "m", "--data", str(TEXT), "--threads", threads])
    except SystemExit as e:  # argparse's refusal
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("kvsplice bench-balance: error:") and what in err and "\n" not in err, err


def test_cli_subprocess_exit_code(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvsplice.cli.bench_balance", "--model", str(tmp_path / "missing"),
                        "--data", "x.txt"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvsplice bench-balance: error:"), p.stderr
