"""``kvsplice distill``: a converted stories260K (shared RoPE, latent norm) fine-tuned by KL distillation
from its source lowers the KL on held-out text, writes the run folder (checkpoints, metrics, model/), resumes, and
its model folder exports to DeepSeek-V3 with the same logits in transformers."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import transformers

from kvsplice.cli import to_mla
from kvsplice.loading import iter_texts, load_model, token_stream
from training import distill

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
STORIES = DATA / "stories260K"
TRAIN = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"
HELD = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"


def stories_pair(root: Path, calib_tokens: int) -> tuple[Path, Path, Path]:
    """``(teacher, student, root)``: stories260K as an HF Llama folder and converted to MLA (d_latent 12, shared RoPE,
    latent norm; ``calib_tokens`` of TinyStories) under ``root`` (skips without the data)."""
    if not ((STORIES / "stories260K.bin").is_file() and TRAIN.is_file()):
        pytest.skip(f"stories260K / TinyStories not found under {DATA}")
    from kvsplice.convert.llama2c import convert_llama2c

    src = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", root / "src")
    assert to_mla.main([str(a) for a in ["--model", src, "--calib", TRAIN, "--calib-tokens", calib_tokens,
                                         "--seq-len", 128, "--d-latent", 12, "--rope-layout", "shared",
                                         "--latent-norm", "--out", root / "mla", "--no-progress"]]) == 0
    return src, root / "mla", root


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    if not HELD.is_file():
        pytest.skip(f"TinyStories' held-out text not found under {DATA}")
    return stories_pair(tmp_path_factory.mktemp("distill"), 4096)


@torch.no_grad()
def held_kl(student, teacher, ids):
    lt = torch.log_softmax(teacher(ids).logits, -1)
    ls = torch.log_softmax(student(ids), -1)
    return float((lt.exp() * (lt - ls)).sum(-1).mean())


def metric_steps(run: Path, key: str = "train_kl") -> list[int]:
    with open(run / "metrics.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get(key)]


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
    rc = distill.main(["--model", str(TRAIN), "--data", str(TRAIN), "--loss", "lm", "--runs-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("kvsplice distill: error:") and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing written


def test_distill_threads_beyond_the_cpus_are_refused(tmp_path, capsys):
    """``--threads 100000`` was handed to torch: a traceback."""
    threads = torch.get_num_threads()
    try:
        rc = distill.main(["--model", str(TRAIN), "--data", str(TRAIN), "--loss", "lm", "--threads", "100000",
                           "--runs-dir", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("kvsplice distill: error: --threads must be <=") and "\n" not in err, err


def test_distill_negative_warmup_is_refused(tmp_path, capsys):
    """``--warmup-steps -1`` trained without a word."""
    try:
        rc = distill.main(["--model", str(TRAIN), "--data", str(TRAIN), "--loss", "lm", "--warmup-steps", "-1",
                           "--runs-dir", str(tmp_path)])
    except SystemExit as e:  # argparse's refusal
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("kvsplice distill: error: argument --warmup-steps: must be >= 0") \
        and "\n" not in err, err


def test_distill_fine_tunes_the_unconverted_source_as_the_same_text_baseline(pair, capsys):
    """The baseline: the source itself, LM loss on the same text; its model/ is a transformers folder every
    kvsplice command loads, its weights moved, and a resumed run continues (the config check accepts it)."""
    src, _, root = pair
    args = ["--model", src, "--loss", "lm", "--data", TRAIN, "--batch-size", 4, "--seq-len", 64, "--val-tokens", 512,
            "--val-every", 2, "--lr", 2e-3, "--runs-dir", root / "runs", "--run-name", "base", "--no-progress"]
    assert distill.main([str(a) for a in args + ["--max-steps", 3]]) == 0, capsys.readouterr().err
    assert distill.main([str(a) for a in args + ["--max-steps", 5, "--ckpt-path", "last"]]) == 0
    run = root / "runs" / "base"
    assert metric_steps(run, "train_lm") == list(range(5))
    tuned, orig = load_model(run / "model"), load_model(src)
    assert tuned.kind == "hf-dir" and type(tuned.model) is type(orig.model)
    ids, _ = token_stream(iter_texts(HELD), orig.tokenizer, 2 * 64)
    with torch.no_grad():
        moved = (tuned.model(ids.view(2, 64)).logits - orig.model(ids.view(2, 64)).logits).abs().max()
    assert moved > 1e-3


@pytest.mark.parametrize("steps,b,t,val", [(1, 4, 128, 4096), (3, 2, 64, 512), (1, 1, 7, 14)])
def test_split_of_tokens_needed_gives_every_batch_and_the_held_out_windows(steps, b, t, val):
    """``--max-steps 1`` refused 300 KB of text: one token short of the last training window."""
    ids = torch.arange(distill.tokens_needed(steps * b * t, val))
    train, held = distill.split(ids, t, val)
    assert train.shape == (steps * b, t + 1) and held.shape == (val // t, t + 1)
    assert int(train[-1, -1]) < int(held[0, 0])  # nothing held out is trained on
    assert torch.equal(train[1:, 0], train[:-1, -1])  # each target is the next window's first input


def test_distill_of_one_step_reads_enough_text(pair, tmp_path, monkeypatch, capsys):
    src, _, _ = pair
    got = {}
    monkeypatch.setattr(distill, "_fit", lambda args, student, teacher, train, *rest: got.update(train=train) or 0)
    rc = distill.main([str(a) for a in ["--model", src, "--loss", "lm", "--data", TRAIN, "--max-steps", 1,
                                        "--runs-dir", tmp_path, "--no-progress"]])
    assert rc == 0, capsys.readouterr().err
    # the default step: 2 x 256 (windows of 256 and 512 in its 512 positions), and room for the longest window
    assert got["train"].shape == (512 + 2,)


def test_distill_batch_beyond_memory_is_refused_before_allocating(pair, tmp_path, capsys):
    """``--batch-size 1000000`` tried to allocate 65 GB of logits: a traceback."""
    src, mla, _ = pair
    rc = distill.main(["--model", str(mla), "--data", str(TRAIN), "--loss", "lm", "--batch-size", "1000000",
                       "--runs-dir", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("kvsplice distill: error: --batch-size: a step of 1000000") and "\n" not in err, err
    assert not any(tmp_path.iterdir())


def test_distill_overwrite_replaces_the_earlier_run(pair, capsys):
    """``--overwrite`` starts the run over in its folder: no ``last-v1.ckpt`` / ``best-...-v1`` beside the earlier
    run's files, the curve and metrics of the new run only."""
    src, _, root = pair
    args = ["--model", src, "--loss", "lm", "--data", TRAIN, "--batch-size", 2, "--seq-len", 64, "--val-tokens", 256,
            "--val-every", 1, "--runs-dir", root / "runs", "--run-name", "again", "--no-progress"]
    assert distill.main([str(a) for a in args + ["--max-steps", 2]]) == 0, capsys.readouterr().err
    assert distill.main([str(a) for a in args + ["--max-steps", 1, "--overwrite"]]) == 0, capsys.readouterr().err
    run = root / "runs" / "again"
    names = sorted(p.name for p in run.iterdir())
    assert not [n for n in names if "-v1" in n], names
    assert metric_steps(run, "train_lm") == [0]
    assert len((run / "curve.csv").read_text().splitlines()) == 2  # the header and the one step of the new run
