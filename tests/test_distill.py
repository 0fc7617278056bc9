"""``python -m training.distill``: a converted stories260K (shared RoPE, latent norm) fine-tuned by KL distillation
from its source lowers the KL on held-out text, writes the run folder (checkpoints, metrics, model/), resumes, and
its model folder exports to DeepSeek-V3 with the same logits in transformers."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import transformers

from kvsplice import to_mla
from kvsplice.io.loading import iter_texts, load_model, token_stream
from training import distill

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
STORIES = DATA / "stories260K"
TRAIN = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"
HELD = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    if not ((STORIES / "stories260K.bin").is_file() and TRAIN.is_file() and HELD.is_file()):
        pytest.skip(f"stories260K / TinyStories not found under {DATA}")
    from kvsplice.convert.llama2c import convert_llama2c

    root = tmp_path_factory.mktemp("distill")
    src = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", root / "src")
    assert to_mla.main([str(a) for a in ["--model", src, "--calib", TRAIN, "--calib-tokens", 4096, "--seq-len", 128,
                                         "--d-latent", 12, "--rope-layout", "shared", "--latent-norm",
                                         "--out", root / "mla", "--no-progress"]]) == 0
    return src, root / "mla", root


@torch.no_grad()
def held_kl(student, teacher, ids):
    lt = torch.log_softmax(teacher(ids).logits, -1)
    ls = torch.log_softmax(student(ids), -1)
    return float((lt.exp() * (lt - ls)).sum(-1).mean())


def metric_steps(run: Path) -> list[int]:
    with open(run / "metrics.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train_kl")]


def test_distill_lowers_the_kl_resumes_and_exports(pair, capsys):
    src, mla, root = pair
    args = ["--model", mla, "--teacher", src, "--data", TRAIN, "--batch-size", 4, "--seq-len", 64,
            "--val-tokens", 512, "--val-every", 4, "--lr", 2e-3, "--runs-dir", root / "runs", "--run-name", "r",
            "--no-progress"]
    assert distill.main([str(a) for a in args + ["--max-steps", 8]]) == 0, capsys.readouterr().err
    run = root / "runs" / "r"
    assert (run / "last.ckpt").is_file() and list(run.glob("best-*.ckpt")) and (run / "model" / "config.json").is_file()
    assert metric_steps(run) == list(range(8))
    # resume the same run to 16 steps: the metrics continue without duplicates
    assert distill.main([str(a) for a in args + ["--max-steps", 16, "--ckpt-path", "last"]]) == 0
    assert metric_steps(run) == list(range(16))
    teacher, before, after = load_model(src).model, load_model(mla).model, load_model(run / "model").model
    ids, _ = token_stream(iter_texts(HELD), load_model(src).tokenizer, 2 * 128)
    ids = ids.view(2, 128)
    assert held_kl(after, teacher, ids) < held_kl(before, teacher, ids)
    # the fine-tuned folder exports to DeepSeek-V3 (no calibration needed) with the same logits
    assert to_mla.main(["--model", str(run / "model"), "--format", "deepseek_v3", "--out", str(root / "ds"),
                        "--no-progress"]) == 0
    ds = transformers.AutoModelForCausalLM.from_pretrained(root / "ds", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (ds(ids).logits - after(ids)).abs().max() <= 1e-4


def test_distill_bad_input_is_one_line_exit_2(pair, tmp_path, capsys):
    src, mla, _ = pair
    capsys.readouterr()
    rc = distill.main(["--model", str(mla), "--data", str(TRAIN), "--runs-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "--teacher" in err and len(err.strip().splitlines()) == 1
    rc = distill.main(["--model", str(src), "--data", str(TRAIN), "--loss", "lm", "--runs-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "not a converted MLA folder" in err and len(err.strip().splitlines()) == 1
