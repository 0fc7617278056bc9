"""Hostile output folders and files: a ``.kvsplice-output.json`` marker is a claim, never a command. A marker naming
paths outside its folder, a marker that is a symlink to ``/dev/zero``, a FIFO or a huge file, a hand-written marker
naming a user's file: each is "not ours" — one line (exit 2), nothing deleted — for every writer that uses the
marker (export, to-mla, convert-llama2c). File outputs that are FIFOs or symlinks are refused in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hostile import STORIES260K, one_error, snapshot, tiny_ckpt
from kvsplice.io.cli import UsageError
from kvsplice.io.files import output_file
from kvsplice.io.folders import output_dir, write_dir
from kvsplice.io.marker import MARKER, check_marker

pytestmark = pytest.mark.timeout(120)


def _write(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(text)


def marked_folder(tmp_path: Path, writer: str, files: list, records: dict = None) -> Path:
    """An output folder holding ``config.json`` and a marker of ``writer`` listing ``files``; a victim file beside
    the folder."""
    out = tmp_path / "out"
    out.mkdir()
    _write(out, "config.json", "{}")
    (tmp_path / "victim.txt").write_text("precious")
    m = {"writer": writer, "files": files}
    if records is not None:
        m["records"] = records
    (out / MARKER).write_text(json.dumps(m))
    return out


HOSTILE_FILES = {
    "dot-dot": ["config.json", "../victim.txt"],
    "absolute": ["config.json", "{victim}"],
    "a sub-path": ["config.json", "sub/../../victim.txt"],
    "empty": ["config.json", ""],
    "itself": ["config.json", "."],
}


@pytest.mark.parametrize("case", sorted(HOSTILE_FILES))
def test_a_marker_naming_paths_outside_its_folder_is_not_ours(tmp_path, case):
    files = [f.format(victim=tmp_path / "victim.txt") for f in HOSTILE_FILES[case]]
    out = marked_folder(tmp_path, "w", files)
    m, why = check_marker(out)
    assert m is None and "not a plain file name" in why, why
    with pytest.raises(UsageError, match="not a marker kvsplice wrote"):
        output_dir(out, force=True, owned=(), writer="w")
    # write_dir on its own (a library caller that skipped output_dir) never deletes what such a marker names
    write_dir(out, lambda tmp: _write(tmp, "config.json", "new"), owned=(), writer="w")
    assert (tmp_path / "victim.txt").read_text() == "precious"


def test_a_hand_written_marker_naming_a_users_file_deletes_nothing(tmp_path):
    out = marked_folder(tmp_path, "w", ["config.json", "notes.txt"])
    _write(out, "notes.txt", "mine")
    with pytest.raises(UsageError, match="changed since w wrote them"):
        output_dir(out, force=True, owned=(), writer="w")
    write_dir(out, lambda tmp: _write(tmp, "config.json", "new"), owned=(), writer="w")
    assert (out / "notes.txt").read_text() == "mine"


def _a_and_b(tmp: Path) -> None:
    _write(tmp, "a.txt", "1"), _write(tmp, "b.txt", "2")


def test_an_earlier_output_is_replaced_whole(tmp_path):
    out = tmp_path / "out"
    write_dir(out, _a_and_b, owned=(), writer="w")
    assert output_dir(out, force=True, owned=(), writer="w") == out.resolve()
    write_dir(out, lambda tmp: _write(tmp, "a.txt", "3"), owned=(), writer="w")  # b.txt was the earlier output's
    assert sorted(p.name for p in out.iterdir()) == sorted(["a.txt", MARKER])


@pytest.mark.parametrize("change", ["edited", "symlink"])
def test_a_recorded_file_changed_since_is_kept_not_followed_nor_trusted(tmp_path, change):
    """A file of the earlier output edited by the user, or replaced by a symlink to a file of theirs, after the
    marker recorded it: refused in one line, and a library write leaves it (and what it points to) as it is."""
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    write_dir(out, _a_and_b, owned=(), writer="w")
    victim.write_text("precious")
    if change == "edited":
        _write(out, "b.txt", "edited by the user")
    else:
        (out / "b.txt").unlink()
        (out / "b.txt").symlink_to(victim)
    with pytest.raises(UsageError, match=r"changed since w wrote them \(b.txt"):
        output_dir(out, force=True, owned=(), writer="w")
    write_dir(out, lambda tmp: _write(tmp, "a.txt", "3"), owned=(), writer="w")
    kept = (out / "b.txt").is_symlink() if change == "symlink" else (out / "b.txt").read_text() == "edited by the user"
    assert kept and victim.read_text() == "precious"


def _zero_link(p: Path) -> None:
    p.symlink_to("/dev/zero")


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _huge(p: Path) -> None:
    with open(p, "wb") as f:  # sparse: 4 GiB of nothing on disk
        f.truncate(4 << 30)


def _deep(p: Path) -> None:
    p.write_text("[" * 100_000)


@pytest.mark.parametrize("make,why", [(_zero_link, "symbolic link"), (_fifo, "not a regular file"),
                                      (_huge, "larger than"), (_deep, "cannot be read as JSON")])
def test_a_marker_that_is_no_small_regular_file_is_refused_unread(tmp_path, make, why):
    out = tmp_path / "out"
    out.mkdir()
    _write(out, "config.json", "{}")
    make(out / MARKER)
    assert why in check_marker(out)[1]
    for owned in ((), None):
        with pytest.raises(UsageError, match="not a marker kvsplice wrote"):
            output_dir(out, force=True, owned=owned, writer="w")
    assert (out / "config.json").read_text() == "{}"


# ------------------------------------------------------------------------------- every writer, as commands run
@pytest.fixture(scope="module")
def writers(tmp_path_factory):
    """``{verb: (main, PROG, WRITER, argv before --out)}`` of the three writers that own their folder."""
    from kvsplice.cli import convert_llama2c, to_mla
    from kvsplice.convert import llama2c, llama_run
    from training import export

    d = tmp_path_factory.mktemp("w")
    ckpt = tiny_ckpt(d / "tiny.ckpt", d / "cache")
    out = {"export": (export.main, export.PROG, export.WRITER, ["--ckpt", ckpt, "--no-tokenizer"])}
    if (STORIES260K / "stories260K.bin").is_file():
        bin_ = STORIES260K / "stories260K.bin"
        hf = llama2c.convert_llama2c(bin_, STORIES260K / "tok512.bin", d / "s260k")
        out["convert-llama2c"] = (convert_llama2c.main, convert_llama2c.PROG, llama2c.WRITER, [bin_])
        text = d / "calib.txt"  # a text file: --calib is checked before the output folder
        text.write_text("Once upon a time there was a cat.\n")
        out["to-mla"] = (to_mla.main, to_mla.PROG, llama_run.WRITER, ["--model", hf, "--calib", text])
    return out


@pytest.mark.parametrize("verb", ["export", "to-mla", "convert-llama2c"])
@pytest.mark.parametrize("files,expect", [(["../victim.txt"], "not a marker kvsplice wrote"),
                                           (["{victim}"], "not a marker kvsplice wrote"),
                                           (["config.json", "notes.txt"], "changed since")])
def test_force_deletes_nothing_a_hostile_marker_names(writers, verb, files, expect, tmp_path, capsys):
    if verb not in writers:
        pytest.skip("stories260K not found")
    main, prog, writer, argv = writers[verb]
    out = marked_folder(tmp_path, writer, [f.format(victim=tmp_path / "victim.txt") for f in files])
    _write(out, "notes.txt", "mine")
    before = snapshot(tmp_path)
    capsys.readouterr()
    rc = main([str(a) for a in [*argv, "--out", out, "--force"]])
    one_error(rc, capsys.readouterr().err, prog, expect)
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------------- file outputs
def test_an_out_that_is_a_fifo_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "results.json"
    os.mkfifo(fifo)
    for force in (False, True):
        with pytest.raises(UsageError, match="not a regular file"):
            output_file(fifo, force=force)


def test_an_out_that_is_a_symlink_is_refused_and_kept(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(UsageError, match="symbolic link"):
        output_file(link, force=True)
    assert link.is_symlink() and target.read_text() == "{}"


def test_eval_tasks_out_fifo_is_one_line_not_a_hang(tmp_path, capsys):
    from kvsplice.cli import eval_tasks

    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)
    capsys.readouterr()
    rc = eval_tasks.main(["--model", str(tmp_path), "--method", "kivi4", "--out", str(fifo)])
    one_error(rc, capsys.readouterr().err, eval_tasks.PROG, "not a regular file")


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_claim_file_planted_beside_an_output_is_never_written_through(tmp_path, kind):
    """``.<name>.claim`` is opened read-write and truncated to hold the pid: through a planted symlink that truncated
    the file it points to."""
    from kvsplice.io.claims import release_claims

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    mark = tmp_path / ".r.json.claim"
    mark.symlink_to(victim) if kind == "symlink" else os.mkfifo(mark)
    try:
        with pytest.raises(UsageError, match="not a claim file a run made"):
            output_file(tmp_path / "r.json", force=False)
    finally:
        release_claims()
    assert victim.read_text() == "precious" and (mark.is_symlink() if kind == "symlink" else mark.exists())
    with pytest.raises(UsageError, match="not a claim file a run made"):
        output_dir(tmp_path / "r.json", force=False)


@pytest.mark.parametrize("name", ["plan.safetensors", "r.CKPT", "m.gguf"])
def test_a_json_report_named_as_weights_is_refused(tmp_path, name):
    """``--json x.safetensors`` wrote JSON text under a weights name (a loader then failed on it far away)."""
    with pytest.raises(UsageError, match="a JSON report named as weights"):
        output_file(tmp_path / name, force=True, option="--json")
    assert not (tmp_path / name).exists()
    assert output_file(tmp_path / "r.json", force=False, option="--json") == (tmp_path / "r.json").resolve()
