"""Hostile input to ``kvsplice to-mla`` on the tiny stories260K model: bad numbers, damaged files, a report aimed
inside the output folder, folders another tool wrote, a full or read-only disk, Ctrl-C after the folder is written.
Every case is one ``kvsplice to-mla: error: ...`` line (exit 2) or one ``interrupted`` line (exit 130), and nothing
a user owns is lost or left half-written."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from hostile import interrupt_at_exit, one_error, one_interrupt, readonly_dir, small_disk, snapshot  # noqa: F401
from kvsplice.cli import to_mla

PROG = to_mla.PROG
DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"
CALIB = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """stories260K as an HF folder (convert_llama2c) and its shared-RoPE MLA conversion (a native to_mla folder)."""
    if not ((STORIES / "stories260K.bin").is_file() and CALIB.is_file()):
        pytest.skip(f"stories260K / TinyStories not found under {DATA}")
    from kvsplice.convert.llama2c import convert_llama2c

    d = tmp_path_factory.mktemp("models")
    hf = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", d / "s260k")
    native = d / "native"
    assert to_mla.main(["--model", str(hf), "--calib", str(CALIB), "--calib-tokens", "4096", "--seq-len", "256",
                        "--d-latent", "24", "--rope-layout", "shared", "--out", str(native), "--no-progress"]) == 0
    return {"hf": hf, "native": native}


def run(args, capsys):
    capsys.readouterr()
    rc = to_mla.main([str(a) for a in args])
    return rc, capsys.readouterr().err


def export_args(models, out, *extra):
    return ["--model", models["native"], "--format", "deepseek_v3", "--out", out, "--no-progress", *extra]


# ------------------------------------------------------------------------------------------------- bad numbers
@pytest.mark.parametrize("extra,expect", [
    (["--pad-latent", "1000000000"], "larger than 4096"),
    (["--pad-rope", "100000000"], "larger than 1024"),
    (["--pad-latent", "4097"], "larger than 4096"),
    (["--pad-rope", "2048"], "larger than 1024"),
    (["--pad-latent", "8"], "smaller than the latent"),
    (["--pad-rope", "12"], "multiple of the RoPE key"),
    (["--pad-latent", "0"], "must be >= 1"),
    (["--pad-rope", "-5"], "must be >= 1"),
    (["--pad-latent", "nan"], "invalid pos_int value"),
])
def test_pads_beyond_the_bounds_are_one_line(models, tmp_path, capsys, extra, expect):
    rc, err = run(export_args(models, tmp_path / "o", *extra), capsys)
    one_error(rc, err, PROG, expect)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra,expect", [
    (["--kvsplice-keep", "1.5"], "must be in (0, 1)"),
    (["--kvsplice-keep", "nan"], "must be in (0, 1)"),
    (["--kvsplice-keep", "0.001", "--calib", CALIB], "asks for 0.024 dimensions"),
    (["--kvsplice-ratio", "0.001", "--calib", CALIB], "--kvsplice-ratio 0.001 of the 24-dim latent"),
    (["--calib-tokens", "0"], "must be >= 1"),
    (["--seq-len", "100000", "--kvsplice-keep", "0.5", "--calib", CALIB], "--seq-len 100000"),
])
def test_bad_numbers_are_one_line(models, tmp_path, capsys, extra, expect):
    rc, err = run(["--model", models["native"], "--out", tmp_path / "o", "--no-progress", *extra], capsys)
    one_error(rc, err, PROG, expect)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------ damaged files
def test_damaged_inputs_are_one_line(models, tmp_path, capsys):
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 2 ** 40) + b'{"a": 1}' + b" " * 64)
    broken = tmp_path / "broken"
    shutil.copytree(models["native"], broken)
    (broken / "config.json").write_text("{not json")
    cut = tmp_path / "cut"
    shutil.copytree(models["native"], cut)
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:1000])
    for model, expect in ((huge, "header too large"), (broken, "config.json"), (cut, "")):
        rc, err = run(["--model", model, "--d-latent", "8", "--out", tmp_path / "o.ckpt", "--no-progress"], capsys)
        one_error(rc, err, PROG, expect)
        assert not (tmp_path / "o.ckpt").exists() and not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------- where outputs land
@pytest.mark.parametrize("report", ["config.json", "report.json", "sub/report.json"])
def test_the_report_never_lands_inside_the_output_folder(models, tmp_path, capsys, report):
    out = tmp_path / "o"
    rc, err = run(export_args(models, out, "--json", out / report), capsys)
    one_error(rc, err, PROG, "inside the output folder")
    assert not out.exists()


def test_force_refuses_a_folder_another_tool_wrote(models, tmp_path, capsys):
    """stories260K's convert_llama2c folder has a config.json and model.safetensors too: to_mla --force refuses it
    (ownership is the marker's) and leaves it as it was — no folder mixing two tools' files."""
    other = tmp_path / "other"
    shutil.copytree(models["hf"], other)
    before = snapshot(other)
    rc, err = run(export_args(models, other, "--force"), capsys)
    one_error(rc, err, PROG, "convert_llama2c wrote them")
    assert snapshot(other) == before


def test_force_replaces_an_earlier_to_mla_folder_whole(models, tmp_path, capsys):
    out = tmp_path / "o"
    shutil.copytree(models["native"], out)  # a native folder to_mla wrote (its marker came along) ...
    marker = json.loads((out / ".kvsplice-output.json").read_text())
    (out / "generation_config.json").write_text("{}")  # ... with a file the new output does not write
    marker["files"].append("generation_config.json")  # ... that the marker lists and records as written
    st = (out / "generation_config.json").stat()
    marker["records"]["generation_config.json"] = [st.st_size, st.st_mtime_ns]
    (out / ".kvsplice-output.json").write_text(json.dumps(marker))
    rc, err = run(export_args(models, out, "--force"), capsys)
    assert rc == 0, err
    marker = json.loads((out / ".kvsplice-output.json").read_text())
    names = {p.name for p in out.iterdir()}
    assert marker["writer"] == "to_mla" and names == {*marker["files"], ".kvsplice-output.json"}
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert "generation_config.json" not in names  # the earlier output's file is gone, not left beside the export
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    rc, err = run(export_args(models, out, "--force"), capsys)
    one_error(rc, err, PROG, "holds files to_mla does not write (notes.txt)")
    assert snapshot(out) == before


# ------------------------------------------------------------------------------------------------------ disks
def test_a_full_disk_is_one_line_and_leaves_nothing(models, tmp_path, capsys):
    with small_disk(tmp_path / "disk") as disk:
        rc, err = run(export_args(models, disk / "o"), capsys)
        one_error(rc, err, PROG, "No space left on device")
        assert list(disk.iterdir()) == []


def test_a_full_disk_for_a_checkpoint_is_one_line(tmp_path, capsys, data_cache):
    from hostile import tiny_ckpt

    ckpt = tiny_ckpt(tmp_path / "mha.ckpt", data_cache)
    with small_disk(tmp_path / "disk") as disk:
        rc, err = run(["--model", ckpt, "--d-latent", "8", "--out", disk / "o.ckpt"], capsys)
        one_error(rc, err, PROG, "cannot write")
        assert list(disk.iterdir()) == []


def test_a_read_only_destination_is_one_line(models, readonly_dir, capsys):
    rc, err = run(export_args(models, readonly_dir / "o"), capsys)
    one_error(rc, err, PROG, "cannot write")


# ------------------------------------------------------------------------------------------------------ Ctrl-C
def test_ctrl_c_after_the_folder_is_written_is_one_line_and_keeps_it(models, tmp_path):
    out = tmp_path / "o"
    r = interrupt_at_exit("kvsplice.cli.to_mla", export_args(models, out))
    one_interrupt(r, PROG)
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert (out / "model.safetensors").is_file()


def test_ctrl_c_while_writing_leaves_nothing(models, tmp_path, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvsplice.convert.deepseek_v3_writer.DeepSeekV3Writer.save", interrupted)
    rc, err = run(export_args(models, tmp_path / "o"), capsys)
    assert rc == 130 and err.strip().splitlines() == [f"{PROG}: interrupted"]
    assert list(tmp_path.iterdir()) == []
