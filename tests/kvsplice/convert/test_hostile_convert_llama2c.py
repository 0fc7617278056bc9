"""Hostile input to ``kvsplice convert-llama2c`` on stories260K: damaged and hostile headers, a folder another tool
wrote, a full or read-only disk, Ctrl-C after the folder is written. Every case is one ``kvsplice convert-llama2c:
error: ...`` line (exit 2) or one ``interrupted`` line (exit 130), and nothing a user owns is lost or left
half-written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from hostile import interrupt_at_exit, one_error, one_interrupt, readonly_dir, small_disk, snapshot  # noqa: F401
from kvsplice.cli import convert_llama2c as cli

PROG = cli.PROG
STORIES = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "stories260K"
MODEL_BIN, TOK_BIN = STORIES / "stories260K.bin", STORIES / "tok512.bin"
pytestmark = pytest.mark.skipif(not MODEL_BIN.is_file(), reason=f"{MODEL_BIN} not found")


def run(argv, capsys):
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def header_v0(tmp_path: Path, dims: tuple[int, ...], name: str) -> Path:
    """A legacy llama2.c header ``(dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len)`` and a few
    floats."""
    p = tmp_path / name
    p.write_bytes(struct.pack("<7i", *dims) + b"\0" * 64)
    return p


@pytest.mark.parametrize("dims,name", [
    ((2 ** 30, 2 ** 30, 2 ** 20, 8, 8, 512, 512), "huge.bin"),
    ((-64, 128, 2, 8, 8, 512, 512), "negative.bin"),
    ((64, 128, 2, 0, 0, 512, 512), "zero-heads.bin"),
    ((64, 128, 2, 8, 8, 512, 0), "zero-context.bin"),
    ((64, 128, 2, 7, 7, 512, 512), "indivisible.bin"),
])
def test_hostile_headers_are_one_line(tmp_path, capsys, dims, name):
    rc, err = run([header_v0(tmp_path, dims, name), "--out", tmp_path / "o"], capsys)
    one_error(rc, err, PROG)
    assert not (tmp_path / "o").exists()


def test_a_tokenizer_of_another_vocabulary_is_one_line(tmp_path, capsys):
    tok = tmp_path / "tok.bin"
    tok.write_bytes(struct.pack("<i", 8) + struct.pack("<fi", 0.0, 1) + b"a")  # one token, not 512
    rc, err = run([MODEL_BIN, "--tokenizer", tok, "--out", tmp_path / "o"], capsys)
    one_error(rc, err, PROG)
    assert not (tmp_path / "o").exists()


def test_a_folder_another_tool_marked_is_refused_even_with_force(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / ".kvsplice-output.json").write_text(json.dumps({"writer": "export", "files": ["config.json"]}))
    before = snapshot(other)
    rc, err = run([MODEL_BIN, "--tokenizer", TOK_BIN, "--out", other, "--force"], capsys)
    one_error(rc, err, PROG, "export wrote them")
    assert snapshot(other) == before


def test_force_replaces_its_own_earlier_files_and_keeps_the_users(tmp_path, capsys):
    out = tmp_path / "o"
    assert run([MODEL_BIN, "--tokenizer", TOK_BIN, "--out", out], capsys)[0] == 0
    (out / "notes.txt").write_text("mine")
    rc, err = run([MODEL_BIN, "--out", out, "--force"], capsys)  # weights only this time
    assert rc == 0, err
    names = {p.name for p in out.iterdir()}
    assert "notes.txt" in names and "tokenizer.json" not in names  # the earlier tokenizer is not left beside it
    assert json.loads((out / ".kvsplice-output.json").read_text())["writer"] == "convert_llama2c"


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys):
    with small_disk(tmp_path / "disk") as disk:
        rc, err = run([MODEL_BIN, "--tokenizer", TOK_BIN, "--out", disk / "o"], capsys)
        one_error(rc, err, PROG, "No space left on device")
        assert list(disk.iterdir()) == []


def test_a_read_only_destination_is_one_line(readonly_dir, capsys):
    rc, err = run([MODEL_BIN, "--out", readonly_dir / "o"], capsys)
    one_error(rc, err, PROG, "cannot write")


def test_ctrl_c_after_the_folder_is_written_is_one_line_and_keeps_it(tmp_path):
    out = tmp_path / "o"
    r = interrupt_at_exit("kvsplice.cli.convert_llama2c", [MODEL_BIN, "--tokenizer", TOK_BIN, "--out", out])
    one_interrupt(r, PROG)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
