"""training.evaluate on tiny checkpoints: the comparison table, JSON, plots, cache bytes vs verify_memory, errors."""

import json

import pytest
import torch

from kvsplice.report.memory import cache_bytes_formula
from models import GPT, GPTConfig
from training import evaluate
from training.checkpoint import CKPT_FORMAT, CKPT_FORMAT_KEY, GPT_CONFIG_KEY


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two checkpoints in the exact format training.fit writes (weights_only-safe dicts), one per variant."""
    root = tmp_path_factory.mktemp("ckpts")
    data_hp = {"synthetic": True, "synthetic_stories": 600, "cache_dir": str(root / "data"), "block_size": 32}
    from data import TinyStoriesDataModule

    vocab = TinyStoriesDataModule(**data_hp).vocab_size
    out = {}
    for name, kw in {"mha": dict(attention="mha"), "kvsplice": dict(attention="mla", kvsplice_keep=0.25)}.items():
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=vocab, n_layer=2, n_head=2, d_model=32, block_size=32, d_latent=16, **kw)
        model = GPT(cfg)
        ckpt = {CKPT_FORMAT_KEY: CKPT_FORMAT, GPT_CONFIG_KEY: cfg.to_dict(), "global_step": 7, "epoch": 0,
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "datamodule_hyper_parameters": data_hp}
        (root / name).mkdir()
        path = root / name / "last.ckpt"
        torch.save(ckpt, path)
        (root / name / "metrics.csv").write_text("step,val_loss\n3,6.0\n7,5.5\n")
        out[name] = (path, cfg)
    return out


ARGS = ["--tokens", "512", "--batch-size", "4", "--decode-tokens", "4", "--repeats", "1", "--sample-tokens", "4",
        "--cache-tokens", "20", "--context", "32"]


def test_table_json_and_plots(ckpts, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = evaluate.main(["--ckpt", str(ckpts["mha"][0]), "--ckpt", str(ckpts["kvsplice"][0]), *ARGS,
                        "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "| variant | steps | val loss | ppl | cache bytes/token (fp32)" in table
    assert "| mha | 7 |" in table and "| mla_kvsplice_75 | 7 |" in table
    rows = json.loads(out.read_text())["rows"]
    for r, (_, cfg) in zip(rows, (ckpts["mha"], ckpts["kvsplice"])):
        assert r["val_tokens"] >= 512 and r["ppl"] == pytest.approx(torch.tensor(r["val_loss"]).exp().item())
        # the real cache's bytes per token == the formula == what verify_memory's formula says
        assert r["cache_bytes_per_token"] == cache_bytes_formula(cfg, 1, "fp32")
        assert r["cache_matches_formula"] and r["decode_tokens_per_s"] > 0 and len(r["samples"]) == 3
    assert rows[0]["compression_vs_mha"] == 1.0
    assert rows[1]["compression_vs_mha"] == pytest.approx(2 * 32 / 4)  # 2·d_model / d_compressed
    assert (tmp_path / "eval_quality_vs_cache.png").stat().st_size > 0
    assert (tmp_path / "eval_val_loss.png").stat().st_size > 0


def test_cache_bytes_agree_with_verify_memory(ckpts, tmp_path):
    from kvsplice.cli import verify_memory

    out = tmp_path / "mem.json"
    assert verify_memory.main(["--ckpt", str(ckpts["kvsplice"][0]), "--seq-lens", "16", "--dtype", "fp32",
                               "--json", str(out)]) == 0
    mem = json.loads(out.read_text())
    row = next(r for r in mem["rows"] if r.get("seq_len") == 16)
    rc = evaluate.main(["--ckpt", str(ckpts["kvsplice"][0]), *ARGS, "--json", str(tmp_path / "e.json")])
    assert rc == 0
    ev = json.loads((tmp_path / "e.json").read_text())["rows"][0]
    assert ev["cache_bytes_per_token"] * 16 == row["measured_bytes"]


def test_corrupt_and_missing_checkpoints_fail_clearly(ckpts, tmp_path, capsys):
    bad = tmp_path / "corrupt.ckpt"
    bad.write_bytes(b"\x00not a checkpoint" * 10)
    for path, why in [(bad, "not a valid PyTorch checkpoint"), (tmp_path / "nope.ckpt", "does not exist"),
                      (tmp_path, "does not exist (or is not a file)")]:
        assert evaluate.main(["--ckpt", str(path), *ARGS]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [err[0]] and err[0].startswith("kvsplice evaluate: error: ") and why in err[0]  # the only line
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {}}, foreign)
    assert evaluate.main(["--ckpt", str(foreign), *ARGS]) == 2
    assert "not a kvsplice training checkpoint" in capsys.readouterr().err
    # a bad second checkpoint is refused before the first one is evaluated
    assert evaluate.main(["--ckpt", str(ckpts["mha"][0]), "--ckpt", str(tmp_path / "nope.ckpt"), *ARGS]) == 2
    assert capsys.readouterr().err.strip().splitlines()[0].startswith("kvsplice evaluate: error: ")


def test_cache_quant_reports_loss_through_both_caches(ckpts, tmp_path, capsys):
    out = tmp_path / "q.json"
    rc = evaluate.main(["--ckpt", str(ckpts["mha"][0]), "--ckpt", str(ckpts["kvsplice"][0]), *ARGS,
                        "--cache-quant", "int8", "--cache-chunk", "8", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert "| variant | val loss (cache) | val loss (int8 cache) | change |" in capsys.readouterr().out
    for r, (_, cfg) in zip(json.loads(out.read_text())["rows"], (ckpts["mha"], ckpts["kvsplice"])):
        # through the unquantised cache (chunks of 8 appended, then attended) == the full forward
        assert r["val_loss_cached"] == pytest.approx(r["val_loss"], abs=1e-4)
        assert r["val_loss_quant"] != r["val_loss_cached"] and abs(r["val_loss_change"]) < 0.005
        q = cfg.replace(cache_quant="int8")
        assert r["quant_bytes_per_token"] == cache_bytes_formula(q, 1, "fp32") < r["cache_bytes_per_token"]
        assert r["quant_cache_matches_formula"]
