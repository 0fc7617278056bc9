"""Hostile inputs to ``python -m training.export`` (issue 22): nothing a user owns is deleted — not the run folder
of ``--ckpt`` (``--out RUNDIR --force``), not the parent of ``--out some/dir/..``, not ``.``; a read-only
destination is one line; checkpoints with NaN / integer / misshapen weights are refused naming the tensor; an MHA
export of a small vocabulary writes its own end-of-text id, not GPT-2's 50256; ``--force`` replaces exactly an
earlier export's files; a killed export's temporary folder is removed by the next one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hostile import dead_pid, edit_ckpt, one_error, readonly_dir, snapshot, tiny_ckpt  # noqa: F401
from training import export as ex

W = "model.transformer.h.0.attn.c_attn.weight"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache) -> Path:
    """A run folder as training.fit leaves it: checkpoints, config, metrics."""
    d = tmp_path_factory.mktemp("runs") / "tiny_gpt2"
    d.mkdir()
    tiny_ckpt(d / "last.ckpt", data_cache)
    (d / "config.yaml").write_text("model: {}\n")
    (d / "metrics.csv").write_text("step,train_loss\n0,5.0\n")
    return d


def export(argv, capsys):
    capsys.readouterr()
    rc = ex.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def test_force_never_deletes_the_run_folder_or_a_parent(run_dir, tmp_path, capsys, monkeypatch):
    ckpt = run_dir / "last.ckpt"
    before = snapshot(run_dir.parent)
    cases = {  # --out, text of the refusal
        "the run folder (item 1)": (run_dir, "contains the input --ckpt"),
        "its parent through .. (item 2)": (run_dir / "sub" / "..", "contains the input --ckpt"),
        "a symlink to the run folder": (tmp_path / "link", "contains the input --ckpt"),
        "the checkpoint file": (ckpt, "exists and is not a directory"),
    }
    (tmp_path / "link").symlink_to(run_dir)
    for name, (out, expect) in cases.items():
        rc, err = export(["--ckpt", ckpt, "--out", out, "--force"], capsys)
        one_error(rc, err, ex.PROG, expect)
        assert snapshot(run_dir.parent) == before, name
    # some/dir/.. with the checkpoint elsewhere: `some` holds other files, so it is refused, not emptied
    some = tmp_path / "some"
    (some / "dir").mkdir(parents=True)
    (some / "notes.txt").write_text("mine")
    rc, err = export(["--ckpt", ckpt, "--out", some / "dir" / "..", "--force"], capsys)
    one_error(rc, err, ex.PROG, "holds files export does not write (dir, notes.txt)")
    assert sorted(p.name for p in some.iterdir()) == ["dir", "notes.txt"]
    # --out . (item 9: was "PosixPath('.') has an empty name"): a non-empty cwd is refused in one line ...
    monkeypatch.chdir(some)
    rc, err = export(["--ckpt", ckpt, "--out", ".", "--force"], capsys)
    one_error(rc, err, ex.PROG, "holds files export does not write")
    # ... and an empty cwd receives the export (the folder itself is kept: the shell may be in it)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    rc, err = export(["--ckpt", ckpt, "--out", ".", "--no-tokenizer"], capsys)
    assert rc == 0, err
    assert (empty / "model.safetensors").is_file() and Path.cwd() == empty


def test_read_only_or_impossible_destination_is_one_line(run_dir, tmp_path, readonly_dir, capsys):
    ckpt = run_dir / "last.ckpt"
    rc, err = export(["--ckpt", ckpt, "--out", readonly_dir / "hf"], capsys)
    one_error(rc, err, ex.PROG, "cannot write in")
    rc, err = export(["--ckpt", ckpt, "--out", run_dir / "metrics.csv" / "hf"], capsys)
    one_error(rc, err, ex.PROG, "is a file, not a folder")
    rc, err = export(["--ckpt", ckpt, "--out", ""], capsys)
    one_error(rc, err, ex.PROG, "--out is empty")


@pytest.mark.parametrize("name, value, expect", [
    ("nan", torch.full((96, 32), float("nan")), f"tensor {W} holds 3072 NaN/inf values"),
    ("inf", torch.eye(96, 32) / 0.0, f"tensor {W} holds"),
    ("int32", torch.ones(96, 32, dtype=torch.int32), f"tensor {W} has dtype int32"),
    ("shape", torch.zeros(96, 31), f"tensor {W} has shape (96, 31), expected (96, 32)"),
    ("not a tensor", [1.0, 2.0], f"tensor {W} is a list"),
])
def test_checkpoint_tensors_are_checked(run_dir, tmp_path, capsys, name, value, expect):
    bad = edit_ckpt(run_dir / "last.ckpt", tmp_path / f"{name}.ckpt", W, value)
    rc, err = export(["--ckpt", bad, "--out", tmp_path / "out"], capsys)
    assert str(bad) in one_error(rc, err, ex.PROG, expect)
    assert not (tmp_path / "out").exists()


def test_small_vocabulary_mha_export_has_its_own_bos_eos(run_dir, tmp_path, capsys):
    """Item 7: config.json said bos/eos 50256 for a 300-token vocabulary."""
    rc, err = export(["--ckpt", run_dir / "last.ckpt", "--out", tmp_path / "hf"], capsys)
    assert rc == 0, err
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert cfg["vocab_size"] == 300 and cfg["bos_token_id"] == cfg["eos_token_id"] == gen["eos_token_id"] == 0
    rc, err = export(["--ckpt", run_dir / "last.ckpt", "--out", tmp_path / "bare", "--no-tokenizer"], capsys)
    cfg = json.loads((tmp_path / "bare" / "config.json").read_text())
    assert rc == 0 and cfg.get("bos_token_id") is None and cfg.get("eos_token_id") is None


def test_force_replaces_exactly_an_earlier_export(run_dir, tmp_path, data_cache, capsys):
    out = tmp_path / "hf"
    mla = tiny_ckpt(tmp_path / "mla.ckpt", data_cache, attention="mla")
    stale = tmp_path / f".hf.{dead_pid()}.tmp"  # a killed export's temporary folder
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    rc, err = export(["--ckpt", mla, "--out", out, "--no-tokenizer"], capsys)
    assert rc == 0, err
    assert not stale.exists()
    remote = {p.name for p in out.iterdir()}
    assert "modeling_kvsplice_gpt.py" in remote and remote <= ex.EXPORT_FILES
    rc, err = export(["--ckpt", run_dir / "last.ckpt", "--out", out], capsys)
    one_error(rc, err, ex.PROG, "is not empty (use --force")
    rc, err = export(["--ckpt", run_dir / "last.ckpt", "--out", out, "--force"], capsys)
    assert rc == 0, err
    names = {p.name for p in out.iterdir()}  # the GPT-2 export, without the remote code of the earlier one
    assert "modeling_kvsplice_gpt.py" not in names and {"model.safetensors", "tokenizer.json"} <= names
    assert names <= ex.EXPORT_FILES and not [p for p in os.listdir(tmp_path) if p.startswith(".hf.")]
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    # a folder named like an export file is never removed to make room
    trap = tmp_path / "trap"
    (trap / "model.safetensors").mkdir(parents=True)
    (trap / "model.safetensors" / "mine.txt").write_text("mine")
    rc, err = export(["--ckpt", mla, "--out", trap, "--force", "--no-tokenizer"], capsys)
    one_error(rc, err, ex.PROG, "holds a folder named like an output file (model.safetensors)")
    assert (trap / "model.safetensors" / "mine.txt").read_text() == "mine" and os.listdir(trap) == ["model.safetensors"]
