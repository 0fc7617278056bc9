"""verify_memory / bench_decode / plots on tiny configs, and DecodeCache.truncate."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from kvsplice.io.cli import UsageError
from kvsplice.cli import bench_decode, verify_memory
from kvsplice.io import configs as io_configs
from kvsplice.report import decode_timing, memory_check
from kvsplice.report.memory import cache_bytes_formula, mha_cache_bytes, sequences_in_budget
from kvsplice.report.plots import plot_quality_vs_cache, plot_val_loss, read_metric_csv
from models import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[3]

TINY_YAML = """\
seed_everything: 0
trainer:
  max_steps: 10
model:
  n_layer: 2
  n_head: 2
  d_model: 32
  block_size: 16
  d_latent: 16
  attention: {attention}
  kvsplice_keep: {ratio}
  learning_rate: 1.0e-3
  weight_decay: 0.1
data:
  batch_size: 4
"""


def write_tiny(tmp_path, name, attention="mla", ratio="null"):
    p = tmp_path / f"{name}.yaml"
    p.write_text(TINY_YAML.format(attention=attention, ratio=ratio))
    return str(p)


@pytest.fixture
def tiny_configs(tmp_path):
    return [write_tiny(tmp_path, "t_mha", "mha"), write_tiny(tmp_path, "t_mla"),
            write_tiny(tmp_path, "t_ks", ratio=0.25)]


# ------------------------------------------------------------------------------------------------ truncate
def test_truncate_rolls_back_and_reappends():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, n_layer=2, n_head=2, d_model=16, block_size=32, d_latent=8, attention="mla",
                    kvsplice_keep=0.5)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        cache = model.new_cache(2, capacity=12)
        model(idx[:, :10], cache=cache)
        ref = model(idx[:, 10:11], cache=cache)
        assert cache.seq_len == 11
        model(idx[:, 11:12], cache=cache)
        cache.truncate(10)
        assert cache.seq_len == 10 and all(cache.layer_len(i) == 10 for i in range(2))
        assert cache.nbytes() == cache_bytes_formula(cfg, 10, "fp32", 2)
        again = model(idx[:, 10:11], cache=cache)  # same step again after the roll-back
        torch.testing.assert_close(again, ref, atol=0, rtol=0)
        cache.truncate(0)
        assert cache.seq_len == 0 and cache.nbytes() == 0
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(1)  # more than held
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(-1)


def test_memory_helpers():
    cfg = GPTConfig(n_layer=12, d_model=768, attention="mla", d_latent=256, kvsplice_keep=0.1)
    assert mha_cache_bytes(cfg, 1024, "fp16") == 36 * 2**20
    assert cache_bytes_formula(cfg, 1024, "fp16") == 1024 * 12 * 26 * 2
    assert sequences_in_budget(10, 3) == 3 and sequences_in_budget(2, 3) == 0


# ------------------------------------------------------------------------------------------ verify_memory
def test_named_config_reads_past_training_keys_and_refuses_unknown_ones(tmp_path):
    cfg = io_configs.named_config(str(write_tiny(tmp_path, "a", ratio=0.25)))[1]
    assert (cfg.n_layer, cfg.d_model, cfg.kvsplice_keep, cfg.vocab_size) == (2, 32, 0.25, 50304)
    p = tmp_path / "b.yaml"  # LightningCLI class_path / init_args form
    p.write_text("model:\n  class_path: training.lit.LitGPT\n  init_args:\n    n_layer: 3\n    attention: mla\n"
                 "    learning_rate: 0.1\noptimizer:\n  lr: 1\n")
    cfg = io_configs.named_config(str(p))[1]
    assert (cfg.n_layer, cfg.attention) == (3, "mla")
    p.write_text("model:\n  n_layer: 3\n  lr: 0.1\n")  # LitGPT has no lr: a typo, not a setting to skip
    with pytest.raises(UsageError, match="model.lr is not a model field nor a training option"):
        io_configs.named_config(str(p))
    assert io_configs.named_config("mla_kvsplice_90")[1].cache_dim == 26


@pytest.mark.parametrize("name", ["gpt2", "gpt2_gqa4", "gpt2_mqa", "mla", "mla_kvsplice_50", "mla_kvsplice_70",
                                  "mla_kvsplice_90"])
def test_tools_measure_the_model_training_trains(name):
    """A preset is its training YAML: what verify_memory / bench_decode build for NAME is the GPTConfig that
    ``training.fit --config NAME`` constructs (same fields, latent_norm included), vocab padded as the CLI pads it."""
    from models import preset
    from models.config import config_path
    from training.lit import LitGPT

    data = yaml.safe_load(config_path(name).read_text())["model"]
    lit = LitGPT(vocab_size=50257, **{k: v for k, v in data.items()})
    assert io_configs.named_config(name)[1] == lit.config == preset(name)
    if name.startswith("mla"):
        assert lit.config.latent_norm


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_verify_memory_tiny_measured_equals_formula(tmp_path, tiny_configs, dtype, capsys):
    out = tmp_path / "res" / f"mem_{dtype}.json"
    rc = verify_memory.main(["--config", *tiny_configs, "--seq-lens", "16", "32", "--dtype", dtype, "--batch", "2",
                             "--budget-gb", "0.001", "--json", str(out), "--no-progress"])
    assert rc == 0
    captured = capsys.readouterr()
    assert f"dtype {dtype}" in captured.out  # the table header names the dtype
    assert "block_size raised 16 -> 32" in captured.err
    report = json.loads(out.read_text())
    assert report["ok"] and report["dtype"] == dtype and len(report["rows"]) == 6
    bpe = 4 if dtype == "fp32" else 2
    dims = {"t_mha": 64, "t_mla": 16, "t_ks": 4}
    for r in report["rows"]:
        expect = 2 * r["seq_len"] * 2 * dims[r["variant"]] * bpe
        assert r["measured_bytes"] == r["storage_bytes"] == r["formula_bytes"] == expect
        assert r["prefill_tokens"] + r["decode_steps"] == r["seq_len"] and r["decode_steps"] == 8
        assert r["compression_vs_mha"] == pytest.approx(64 / dims[r["variant"]])
        assert r["fits_in_budget"] == int(0.001 * 2**30) // (expect // 2)
        assert r["cache_dtypes"] == [{"fp32": "float32", "fp16": "float16"}[dtype]]
    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000


def test_verify_memory_exits_nonzero_on_mismatch(tmp_path, monkeypatch, capsys):
    real = memory_check.cache_bytes_formula
    monkeypatch.setattr(memory_check, "cache_bytes_formula", lambda *a, **k: real(*a, **k) + 1)
    rc = verify_memory.main(["--config", write_tiny(tmp_path, "x"), "--seq-lens", "8", "--dtype", "fp32",
                             "--no-progress"])
    assert rc == 1
    assert "MISMATCH" in capsys.readouterr().err


@pytest.mark.parametrize("args, msg", [
    (["--config", "no/such/config.yaml"], "config file not found"),
    (["--config", "not_a_preset"], "unknown config"),
    (["--ckpt", "no/such.ckpt"], "checkpoint not found"),
    (["--dtype", "fp8"], "invalid choice"),
    (["--seq-lens", "0"], "--seq-lens"),
    (["--seq-lens", "1000000000", "--config", "mla"], "--seq-lens 1000000000 with --batch 1: the model, prefill and "
                                                      "cache needs about"),
    (["--batch", "1000000000", "--config", "mla"], "--seq-lens 1024 with --batch 1000000000: "),
    (["--decode-steps", "1000000000", "--seq-lens", "16"],
     "--decode-steps must be <= 15 (the shortest --seq-lens 16 less the one token the prefill needs), got 1000000000"),
    (["--budget-gb", "inf"], "--budget-gb must be a finite number"),
    (["--budget-gb", "nan"], "--budget-gb must be a finite number"),
    (["--device", "bogus"], "--device bogus:"),
    (["--device", "cuda:7"], "--device cuda:7:"),
])
def test_verify_memory_bad_args_one_line_exit_2(args, msg, capsys):
    assert verify_memory.main([*args, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err and err.startswith("kvsplice verify-memory: error:")


def test_verify_memory_unreadable_checkpoint_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    assert verify_memory.main(["--ckpt", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.ckpt" in err


def test_verify_memory_cli_subprocess(tmp_path):
    out = tmp_path / "m.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "kvsplice.cli.verify_memory", "--config",
                        write_tiny(tmp_path, "c", ratio=0.5), "--seq-lens", "8", "16", "--dtype", "bf16",
                        "--markdown", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=env)
    assert p.returncode == 0, p.stderr
    assert "| c | 16 |" in p.stdout and "dtype bf16" in p.stdout
    assert json.loads(out.read_text())["rows"][1]["measured_bytes"] == 16 * 2 * 8 * 2
    p = subprocess.run([sys.executable, "-m", "kvsplice.cli.verify_memory", "--config", str(tmp_path / "missing.yaml")],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------- bench_decode
def test_bench_decode_tiny(tmp_path, tiny_configs, capsys):
    out = tmp_path / "bench.json"
    mla = tiny_configs[1]
    rc = bench_decode.main(["--config", mla, f"{mla}:naive", tiny_configs[2], "--ctx", "8", "300", "--batch", "2",
                            "--repeats", "3", "--warmup", "1", "--rounds", "2", "--json", str(out), "--no-progress",
                            "--profile", "--device", "cpu"])  # the profile's copy check reads CPU ops
    assert rc == 0
    assert "added an MHA baseline" in capsys.readouterr().err
    report = json.loads(out.read_text())
    labels = [v["label"] for v in report["variants"]]
    assert labels == ["mha", "t_mla", "t_mla_naive", "t_ks"]
    assert report["variants"][2]["config"]["mla_impl"] == "naive"
    assert all(v["config"]["block_size"] >= 301 for v in report["variants"])
    assert len(report["results"]) == 8
    for r in report["results"]:
        assert r["n"] == 3 and len(r["times_ms"]) == 3 and r["median_ms"] > 0
        assert r["p25_ms"] <= r["median_ms"] <= r["p75_ms"]
        if r["variant"] == "mha":
            assert r["speedup_vs_mha"] == 1.0
        assert math.isfinite(r["speedup_vs_mha"])
    assert set(report["growth"]) == set(labels)
    assert out.with_suffix(".png").stat().st_size > 1000
    # profiler evidence: MHA and the absorbed paths never copy/concatenate anything as large as one layer's cache
    # per step; the naive path re-expands the whole context every step (and is flagged)
    prof = report["profile"]
    assert prof["t_mla"]["ctx"] == 300 and prof["t_mla"]["top_ops"]
    assert not prof["mha"]["copies_cache"] and not prof["t_mla"]["copies_cache"] and not prof["t_ks"]["copies_cache"]
    assert prof["t_mla_naive"]["copies_cache"]


@pytest.mark.parametrize("args, msg", [
    (["--ctx", "1000000000"], "--ctx 1000000000 with --batch 8: the models and the filled cache needs about"),
    (["--batch", "1000000000"], "--ctx 8192 with --batch 1000000000: "),
    (["--threads", "100000"], "--threads must be <= "),
    (["--max-seconds", "-1"], "--max-seconds must be >= 0"),
    (["--max-seconds", "nan"], "--max-seconds must be a finite number"),
    (["--repeats", "1000000000"], "--repeats must be <= 100000, got 1000000000"),
    (["--device", "bogus"], "--device bogus:"),
    (["--device", "cuda:7"], "--device cuda:7:"),
])
def test_bench_decode_sizes_and_devices_refused_up_front(args, msg, capsys):
    assert bench_decode.main([*args, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err and err.startswith("kvsplice bench-decode: error:"), err


def test_bench_decode_bad_args(capsys):
    assert bench_decode.main(["--config", "gpt2:naive", "--no-progress"]) == 2
    assert bench_decode.main(["--ctx", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("kvsplice bench-decode: error:") for e in err)


def test_filled_cache_and_fixed_context():
    cfg = GPTConfig(vocab_size=50, n_layer=2, n_head=2, d_model=16, block_size=64, attention="mha")
    model = GPT(cfg).eval()
    cache = decode_timing.filled_cache(model, 3, 20, torch.Generator().manual_seed(0))
    assert cache.seq_len == 20 and cache.storage_nbytes() == cache_bytes_formula(cfg, 21, "fp32", 3)
    ts = decode_timing.time_steps(model, cache, 20, torch.zeros(3, 1, dtype=torch.long), warmup=1, repeats=2)
    assert len(ts) == 2 and cache.seq_len == 20
    ts = decode_timing.time_steps(model, cache, 20, torch.zeros(3, 1, dtype=torch.long), warmup=1, repeats=5,
                                 max_seconds=0.0)
    assert len(ts) == 1 and cache.seq_len == 20  # time cap: stop after the first timed step


# --------------------------------------------------------------------------------------------------- plots
def test_plot_val_loss_tolerates_missing_columns_and_nan(tmp_path):
    run = tmp_path / "logs" / "mla" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("epoch,step,train_loss,val_loss\n0,9,4.1,\n0,9,,3.9\n0,19,3.5,\n"
                                     "0,19,,nan\n0,29,,3.2\n")
    other = tmp_path / "other.csv"
    other.write_text("epoch,step,train_loss\n0,1,2.0\n")
    assert read_metric_csv(run / "metrics.csv") == [(9.0, 3.9), (29.0, 3.2)]
    assert read_metric_csv(other) == []
    out = plot_val_loss([run / "metrics.csv", other, tmp_path / "missing.csv"], tmp_path / "p" / "val.png")
    assert out.stat().st_size > 1000
    empty = plot_val_loss([other], tmp_path / "empty.png")
    assert empty.stat().st_size > 1000


def test_plot_quality_vs_cache(tmp_path):
    pts = [dict(variant="mha", val_loss=3.1, cache_bytes_per_token=36864),
           dict(variant="mla", val_loss=3.2, cache_bytes_per_token=6144),
           dict(variant="broken", val_loss=float("nan"), cache_bytes_per_token=1)]
    assert plot_quality_vs_cache(pts, tmp_path / "q.png").stat().st_size > 1000


def test_verify_memory_int8_rows(tiny_configs, tmp_path, capsys):
    out = tmp_path / "q.json"
    rc = verify_memory.main(["--config", *tiny_configs, "--seq-lens", "8", "16", "--dtype", "fp16", "--cache-quant",
                             "int8", "--no-progress", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    quant = [r for r in rows if r["variant"].endswith("+int8")]
    assert len(quant) == len(rows) - len(quant) == 6 and all(r["ok"] for r in rows)  # 3 configs × 2 lengths
    for r in quant:
        base = next(p for p in rows if p["variant"] == r["variant"][:-5] and p["seq_len"] == r["seq_len"])
        assert r["measured_bytes"] == r["formula_bytes"] < base["measured_bytes"]
        assert r["compression_vs_mha"] > base["compression_vs_mha"]  # same fp16 MHA reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_bench_decode_with_graphs_and_verify_memory(tmp_path, tiny_configs, dtype, capsys):
    """On CUDA: bench_decode times eager and CUDA-graph steps side by side (CUDA events), and verify_memory's
    allocator check (bytes requested by new_cache == formula, nothing left behind by prefill + decode) passes."""
    out = tmp_path / "b.json"
    mha, mla, ks = tiny_configs
    rc = bench_decode.main(["--config", mha, f"{mha}:graph", mla, f"{mla}:graph", ks, f"{ks}:graph", "--ctx", "8",
                            "64", "--batch", "2", "--repeats", "4", "--rounds", "2", "--dtype", dtype, "--device",
                            "cuda", "--json", str(out), "--no-progress"])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["variant"] for r in rows} == {"t_mha", "t_mha+graph", "t_mla", "t_mla+graph", "t_ks", "t_ks+graph"}
    assert all(r["median_ms"] > 0 for r in rows)
    assert all("time_vs_eager" in r for r in rows if r["cuda_graph"])
    rc = verify_memory.main(["--config", *tiny_configs, "--seq-lens", "16", "64", "--dtype", dtype, "--device",
                             "cuda", "--cache-quant", "int8", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
