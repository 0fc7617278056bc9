"""``kvsplice distill``'s options (:class:`training.distill_options.DistillOptions`): the command line is built from
the dataclass, and what would fail late or do nothing is refused in one line naming the option, exit 2, before any
model loads — a temperature or learning rate that is not a finite number > 0, --temperature with --loss lm,
--self-tokens / --cache-dir with --data — and --tokens beyond what --data holds before the teacher loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostile import one_error
from training import distill
from training.distill_options import DistillOptions

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
STORIES = DATA / "stories260K"
TRAIN = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"


@pytest.fixture
def no_loading(monkeypatch):
    import kvsplice.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded a model before refusing"))


@pytest.mark.parametrize("extra, needle", [
    (["--temperature", "0"], "argument --temperature: must be a finite number > 0, got 0"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number > 0, got nan"),
    (["--temperature", "-1"], "argument --temperature: must be a finite number > 0"),
    (["--lr", "0"], "argument --lr: must be a finite number > 0, got 0"),
    (["--lr", "inf"], "argument --lr: must be a finite number > 0"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0"),
    (["--lr", "1e12"], "--lr 1e+12 is above 1: every step would move each weight by more than its size"),
    (["--loss", "lm", "--temperature", "2"], "--temperature is the KL's; with --loss lm it does nothing"),
    (["--loss", "lm", "--data", "x.txt", "--self-tokens", "100"], "--self-tokens sizes / places the teacher's own"),
    (["--loss", "lm", "--data", "x.txt", "--cache-dir", "c"], "--cache-dir sizes / places the teacher's own text"),
])
def test_distill_refuses_before_loading_a_model(tmp_path, capsys, no_loading, extra, needle):
    rc = distill.main(["--model", str(tmp_path / "m"), "--teacher", str(tmp_path / "t"), *extra,
                       "--runs-dir", str(tmp_path / "runs"), "--no-progress"])
    one_error(rc, capsys.readouterr().err, "distill", needle)
    assert not (tmp_path / "runs").exists()


def test_the_options_object_is_the_command_line():
    o = distill.options(["--model", "m", "--data.path", "d.txt", "--loss", "lm", "--seq-len", "64", "128",
                         "--snapshot-minutes", "1", "2.5", "--no-progress", "--threads", "1"])
    assert o == DistillOptions(model="m", data="d.txt", loss="lm", seq_len=(64, 128), snapshot_minutes=(1.0, 2.5),
                               progress=False, threads=1)
    assert (o.lr, o.kl_temperature, o.batch_size, o.val_tokens, o.runs_dir) == (2e-4, 1.0, 2, 4096, "checkpoints")
    assert DistillOptions(model="m", temperature=2.0).kl_temperature == 2.0
    with pytest.raises(ValueError, match="--lr must be a finite number > 0"):
        DistillOptions(model="m", lr=float("nan"))  # the library refuses what the command line refuses


def test_distill_refuses_more_tokens_than_the_data_holds(tmp_path, capsys, monkeypatch):
    """``--tokens`` beyond the file read less without a word; now one line naming the file's tokens, before the
    teacher loads (the count is in the student's tokens)."""
    if not ((STORIES / "stories260K.bin").is_file() and TRAIN.is_file()):
        pytest.skip(f"stories260K / TinyStories not found under {DATA}")
    from kvsplice.convert.llama2c import convert_llama2c
    import kvsplice.loading as loading

    src = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path / "src")
    text = tmp_path / "short.txt"
    text.write_text(TRAIN.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    load = loading.load_model
    loaded = []
    monkeypatch.setattr(loading, "load_model", lambda spec, *a, **k: loaded.append(spec) or load(spec, *a, **k))
    rc = distill.main(["--model", str(src), "--teacher", str(tmp_path / "teacher"), "--data", str(text),
                       "--tokens", "100000", "--val-tokens", "64", "--runs-dir", str(tmp_path / "runs"),
                       "--no-progress"])
    line = one_error(rc, capsys.readouterr().err, "distill", "--tokens 100,000: --data")
    n = int(line.split(" holds ")[1].split(" tokens")[0].replace(",", ""))
    assert 0 < n < 100_000 and f"at most {n - 66:,}" in line
    assert loaded == [str(src)] and not (tmp_path / "runs").exists()
