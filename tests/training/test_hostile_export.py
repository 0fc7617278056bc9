"""Hostile input to ``kvsplice export``: bad numbers, damaged checkpoints, folders
another tool wrote, a full or read-only disk, Ctrl-C during the imports and after the export is written. Every case
is one ``kvsplice export: error: ...`` line (exit 2) or one ``interrupted`` line (exit 130), and nothing a user owns
is lost or left half-written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from hostile import (interrupt_at_exit, interrupt_on_import, one_error, one_interrupt, readonly_dir,  # noqa: F401
                     small_disk, snapshot)
from models import GPT
from models.checkpoint import save_model
from models.config import GPTConfig
from tiny_models import sharpen
from training import export as ex

PROG = ex.PROG
DS = dict(vocab_size=97, n_layer=2, n_head=4, d_model=32, block_size=64, d_latent=16, bias=False,
          layout="deepseek_v3", d_ff=88, attention="mla", qk_rope_head_dim=8, latent_norm=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """A deepseek_v3-layout MLA checkpoint and a GPT-2-layout MLA one (remote-code export)."""
    d = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    ds = save_model(sharpen(GPT(GPTConfig(**DS)), std=0.2), d / "ds.ckpt")
    torch.manual_seed(0)
    gpt = save_model(sharpen(GPT(GPTConfig(vocab_size=97, n_layer=2, n_head=4, d_model=32, block_size=64,
                                           d_latent=16, attention="mla")), std=0.2), d / "mla.ckpt")
    return {"ds": ds, "mla": gpt}


def export(argv, capsys):
    capsys.readouterr()
    rc = ex.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


# ------------------------------------------------------------------------------------------------- bad numbers
@pytest.mark.parametrize("opt,value,expect", [
    ("--pad-latent", 1_000_000_000, "larger than 4096"),
    ("--pad-rope", 100_000_000, "larger than 1024"),
    ("--pad-latent", 4097, "larger than 4096"),
    ("--pad-rope", 1032, "larger than 1024"),
    ("--pad-latent", -5, "smaller than the latent"),
    ("--pad-latent", 0, "smaller than the latent"),
    ("--pad-rope", 12, "multiple of the RoPE key"),
    ("--pad-rope", "1e9", "invalid int value"),
])
def test_pad_beyond_the_bounds_is_one_line(ckpts, tmp_path, capsys, opt, value, expect):
    rc, err = export(["--ckpt", ckpts["ds"], "--out", tmp_path / "o", "--no-tokenizer", opt, value], capsys)
    one_error(rc, err, PROG, expect)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------ damaged files
def _damaged(tmp_path: Path, kind: str, good: Path) -> Path:
    p = tmp_path / (f"{kind}.safetensors" if kind.startswith("safetensors") else f"{kind}.ckpt")
    if kind == "safetensors-huge-header":
        p.write_bytes(struct.pack("<Q", 2 ** 40) + b'{"a": 1}' + b" " * 64)
    elif kind == "safetensors-bad-json":
        p.write_bytes(struct.pack("<Q", 8) + b"{notjson")
    elif kind == "truncated":
        p.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif kind == "empty":
        p.write_bytes(b"")
    elif kind == "directory":
        p.mkdir()
    return p


@pytest.mark.parametrize("kind,expect", [
    ("safetensors-huge-header", "header too large"), ("safetensors-bad-json", "cannot read checkpoint"),
    ("truncated", "cannot read checkpoint"), ("empty", "cannot read checkpoint"), ("directory", "not a file"),
])
def test_a_damaged_checkpoint_is_one_line(ckpts, tmp_path, capsys, kind, expect):
    bad = _damaged(tmp_path, kind, ckpts["ds"])
    rc, err = export(["--ckpt", bad, "--out", tmp_path / "o"], capsys)
    one_error(rc, err, PROG, expect)
    assert not (tmp_path / "o").exists()


# -------------------------------------------------------------------------------------------------- ownership
def test_force_refuses_a_folder_another_tool_wrote_even_with_the_same_names(ckpts, tmp_path, capsys):
    """Ownership is the marker's, not the file names': a folder holding exactly an export's file names that export
    did not write, or that another tool's marker claims, is refused with --force, and left as it was."""
    same_names = tmp_path / "same"
    same_names.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (same_names / name).write_text("another tool's")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / ".kvsplice-output.json").write_text(json.dumps({"writer": "convert_llama2c", "files": ["config.json"]}))
    for folder, expect in ((same_names, "no .kvsplice-output.json marker"), (other, "convert_llama2c wrote them")):
        before = snapshot(folder)
        rc, err = export(["--ckpt", ckpts["ds"], "--out", folder, "--force", "--no-tokenizer"], capsys)
        one_error(rc, err, PROG, expect)
        assert snapshot(folder) == before


def test_force_replaces_an_earlier_export_whole_and_refuses_a_file_added_to_it(ckpts, tmp_path, capsys):
    out = tmp_path / "o"
    assert export(["--ckpt", ckpts["mla"], "--out", out, "--no-tokenizer"], capsys)[0] == 0  # remote code
    assert (out / "modeling_kvsplice_gpt.py").is_file()
    rc, err = export(["--ckpt", ckpts["ds"], "--out", out, "--force", "--no-tokenizer"], capsys)
    assert rc == 0, err
    marker = json.loads((out / ".kvsplice-output.json").read_text())
    assert marker["writer"] == "export" and sorted(p.name for p in out.iterdir()) == sorted(
        [*marker["files"], ".kvsplice-output.json"])  # nothing of the remote-code export left beside it
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    rc, err = export(["--ckpt", ckpts["mla"], "--out", out, "--force", "--no-tokenizer"], capsys)
    one_error(rc, err, PROG, "holds files export does not write (notes.txt)")
    assert snapshot(out) == before


# ------------------------------------------------------------------------------------------------------ disks
def test_a_full_disk_is_one_line_and_leaves_nothing(ckpts, tmp_path, capsys):
    with small_disk(tmp_path / "disk") as disk:
        rc, err = export(["--ckpt", ckpts["ds"], "--out", disk / "o", "--no-tokenizer"], capsys)
        one_error(rc, err, PROG, "No space left on device")
        assert list(disk.iterdir()) == []


def test_a_full_disk_under_force_keeps_the_earlier_export(ckpts, tmp_path, capsys):
    first = tmp_path / "first"
    assert export(["--ckpt", ckpts["ds"], "--out", first, "--no-tokenizer"], capsys)[0] == 0
    size = sum(f.stat().st_size for f in first.iterdir())
    with small_disk(tmp_path / "disk", size=size + size // 2) as disk:  # room for one export, not two
        out = disk / "o"
        assert export(["--ckpt", ckpts["ds"], "--out", out, "--no-tokenizer"], capsys)[0] == 0
        before = snapshot(out)
        rc, err = export(["--ckpt", ckpts["ds"], "--out", out, "--force", "--no-tokenizer", "--pad-latent", "64"],
                         capsys)
        one_error(rc, err, PROG, "No space left on device")
        assert snapshot(out) == before


def test_a_read_only_destination_is_one_line(ckpts, readonly_dir, capsys):
    rc, err = export(["--ckpt", ckpts["ds"], "--out", readonly_dir / "o"], capsys)
    one_error(rc, err, PROG, "cannot write")


# ------------------------------------------------------------------------------------------------------ Ctrl-C
def test_ctrl_c_during_the_imports_is_one_line(ckpts, tmp_path):
    r = interrupt_on_import("training.export", ["--ckpt", ckpts["ds"], "--out", tmp_path / "o"])
    one_interrupt(r, PROG)
    assert not (tmp_path / "o").exists()


def test_ctrl_c_after_the_export_is_written_is_one_line_and_keeps_it(ckpts, tmp_path):
    out = tmp_path / "o"
    r = interrupt_at_exit("training.export", ["--ckpt", ckpts["ds"], "--out", out, "--no-tokenizer"])
    one_interrupt(r, PROG)
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert (out / "model.safetensors").is_file() and not list(tmp_path.glob(".o.*"))


def test_ctrl_c_while_writing_leaves_nothing(ckpts, tmp_path, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvsplice.convert.deepseek_v3_writer.DeepSeekV3Writer.save", interrupted)
    capsys.readouterr()
    assert ex.main(["--ckpt", str(ckpts["ds"]), "--out", str(tmp_path / "o"), "--no-tokenizer"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [f"{PROG}: interrupted"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
