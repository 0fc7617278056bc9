"""Hostile inputs to ``python -m kvsplice.to_mla`` (issue 22): ``--out`` never replaces an input (the same path, a
symlink, a hard link, another spelling; ``--json`` too), errors exit 2 in one line (a read-only destination
included), source checkpoints with NaN / integer weights are refused naming the tensor, and the temporary file a
killed run left beside ``--out`` is removed by the next run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hostile import dead_pid, edit_ckpt, one_error, readonly_dir, snapshot, tiny_ckpt  # noqa: F401
from kvsplice.to_mla import main as to_mla
from models.checkpoint import load_gpt_checkpoint

W = "model.transformer.h.1.attn.c_attn.weight"


@pytest.fixture(scope="module")
def src(tmp_path_factory, data_cache) -> Path:
    return tiny_ckpt(tmp_path_factory.mktemp("src") / "X.ckpt", data_cache)


def convert(argv, capsys):
    capsys.readouterr()
    rc = to_mla([str(a) for a in argv])
    return rc, capsys.readouterr().err


def test_out_is_never_an_input(src, tmp_path, capsys, monkeypatch):
    calib = tmp_path / "calib.txt"
    calib.write_text("Once upon a time there was a cat.\n\nThe cat was happy.\n")
    (tmp_path / "link.ckpt").symlink_to(src)
    os.link(src, tmp_path / "hard.ckpt")
    monkeypatch.chdir(src.parent)
    before = snapshot(src.parent) | snapshot(tmp_path)
    base = ["--model", src, "--d-latent", "8"]
    cases = {  # item 4: the source checkpoint replaced by its own conversion
        "the same path": ["--out", src, "--force"],
        "a relative spelling": ["--out", Path("sub/../X.ckpt"), "--force"],
        "a symlink to it": ["--out", tmp_path / "link.ckpt", "--force"],
        "a hard link to it": ["--out", tmp_path / "hard.ckpt", "--force"],
        "--json": ["--out", tmp_path / "new.ckpt", "--json", src, "--force"],
        "the calibration text": ["--out", calib, "--calib", calib, "--force"],
    }
    for name, extra in cases.items():
        rc, err = convert(base + extra, capsys)
        one_error(rc, err, "to_mla", "writing it would replace the input")
        assert snapshot(src.parent) | snapshot(tmp_path) == before, name
    rc, err = convert(base + ["--out", tmp_path / "o.ckpt", "--json", tmp_path / "o.ckpt"], capsys)
    one_error(rc, err, "to_mla", "--json")
    assert not (tmp_path / "o.ckpt").exists()


def test_errors_exit_2_in_one_line(src, tmp_path, readonly_dir, capsys):
    """Item 10: to_mla exited 1 (argparse's own errors 2, with a usage block)."""
    cases = [
        (["--model", src, "--out", tmp_path / "o.ckpt"], "give --d-latent"),
        (["--model", src, "--d-latent", "8", "--out", tmp_path], "is a directory"),
        (["--model", src, "--d-latent", "8", "--out", "."], "is a directory"),
        (["--model", src, "--d-latent", "8", "--out", readonly_dir / "o.ckpt"], "cannot write in"),
        (["--model", src, "--d-latent", "0", "--out", tmp_path / "o.ckpt"], "must be >= 1"),
        (["--model", src, "--d-latent", "8"], "--out"),
        (["--model", tmp_path / "missing.ckpt", "--d-latent", "8", "--out", tmp_path / "o.ckpt"], "not found"),
    ]
    for argv, expect in cases:
        rc, err = convert(argv, capsys)
        one_error(rc, err, "to_mla", expect)
    assert not (tmp_path / "o.ckpt").exists()


@pytest.mark.parametrize("name, value, expect", [
    ("nan", torch.full((96, 32), float("nan")), f"tensor {W} holds 3072 NaN/inf values"),
    ("int32", torch.ones(96, 32, dtype=torch.int32), f"tensor {W} has dtype int32"),
    ("bool", torch.ones(96, 32, dtype=torch.bool), f"tensor {W} has dtype bool"),
])
def test_source_tensors_are_checked(src, tmp_path, capsys, name, value, expect):
    bad = edit_ckpt(src, tmp_path / f"{name}.ckpt", W, value)
    rc, err = convert(["--model", bad, "--d-latent", "8", "--out", tmp_path / "o.ckpt"], capsys)
    assert str(bad) in one_error(rc, err, "to_mla", expect)
    assert not (tmp_path / "o.ckpt").exists()


def test_a_killed_runs_temporary_file_is_removed(src, tmp_path, capsys):
    out = tmp_path / "out.ckpt"
    stale = tmp_path / f".out.ckpt.{dead_pid()}.tmp"  # what atomic_save leaves when to_mla is killed mid-write
    stale.write_bytes(b"half a checkpoint")
    live = tmp_path / f".out.ckpt.{os.getppid()}.tmp"  # a live process's write in progress
    live.write_bytes(b"x")
    other = tmp_path / f".other.ckpt.{dead_pid()}.tmp"  # another file's: not this command's business
    other.write_bytes(b"x")
    rc, err = convert(["--model", src, "--d-latent", "8", "--out", out], capsys)
    assert rc == 0, err
    assert not stale.exists() and live.exists() and other.exists()
    assert load_gpt_checkpoint(out)[1].d_latent == 8
