"""Hostile input to ``plan`` on stories260K (512 positions): bad numbers, lengths beyond the model or below the tuning
tasks' prompts, options that would do nothing, damaged and hostile spec files, a read-only destination and Ctrl-C —
each refused in one line (exit 2) or interrupted in one line (exit 130), and earlier outputs never lost or mixed."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from hostile import one_error, readonly_dir, run_tool, snapshot  # noqa: F401  (readonly_dir: a fixture)
from kvsplice.cli import plan as plan_cli

from benchmarks.harness.paths import CALIB, DATA, STORIES

pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file() or not CALIB.is_file(),
                                reason=f"stories260K / TinyStories not found under {DATA}")
SMALL = ["--calib", str(CALIB), "--calib-tokens", "2048", "--tune-tokens", "512", "--seq-len", "256",
         "--no-progress", "--batch-size", "2"]
FAST = [*SMALL, "--ratio", "3", "--objective", "ppl", "--selectors", "snapkv", "--stores", "int8"]
"""A plan that runs in seconds: no calibration (no low-rank store), one selector, no tuning tasks."""


@pytest.fixture(scope="module")
def s260k(tmp_path_factory) -> Path:
    from kvsplice.convert.llama2c import convert_llama2c

    return convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("s260k"))


def _run(argv, capsys):
    return run_tool(plan_cli.main, argv, capsys)


@pytest.fixture
def no_calibration(monkeypatch):
    """Refusals must come before the calibration (the slow step)."""
    import kvsplice.lowrank.sensitivity as sens

    monkeypatch.setattr(sens, "stats_for", lambda *a, **k: pytest.fail("calibrated before refusing"))


@pytest.mark.parametrize("extra,expect", [
    (["--fit-length", "100000"], "--fit-length 100000 exceeds the model's 512 positions"),
    (["--fit-length", "513"], "--fit-length 513 exceeds the model's 512 positions"),
    (["--tune-length", "64"], "--tune-length: passkey at length 64 builds prompts"),
    (["--tune-length", "1000"], "--tune-length 1000 exceeds the model's 512 positions"),
    (["--seq-len", "4096"], "--seq-len 4096 exceeds"),
    (["--prompt-len", "256"], "--prompt-len"),
    (["--batch-size", "1000000000"], "--batch-size 1000000000 with --seq-len 256: a forward's logits needs about")])
def test_lengths_are_bounded_by_the_model_and_the_tuning_tasks(s260k, tmp_path, capsys, no_calibration, extra,
                                                                expect):
    """--fit-length within the model's positions (a budget "held at 100000 tokens" of a 512-position model is no
    budget of any prompt it runs); --tune-length long enough for every tuning task's prompt — the bound check
    ``eval_tasks --lengths`` makes (passkey prompts need up to 160 tokens)."""
    rc, _, err = _run(["--model", s260k, *SMALL, "--ratio", "3", "--tune-tasks", "passkey", *extra,
                       "--out", tmp_path / "p.json"], capsys)
    one_error(rc, err, "plan", expect)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("extra,expect", [
    (["--ratio", "nan"], "--ratio"), (["--ratio", "inf"], "--ratio"), (["--ratio", "-2"], "--ratio"),
    (["--ratio", "1"], "must be > 1"), (["--ratio", "x"], "--ratio"),
    (["--budget-bytes-per-token", "0"], "--budget-bytes-per-token"),
    (["--budget-bytes-per-token", "1e999"], "--budget-bytes-per-token"),
    (["--ratio", "3", "--calib-tokens", "0"], "--calib-tokens"),
    (["--ratio", "3", "--tune-n", "-1"], "--tune-n"), (["--ratio", "3", "--batch-size", "0"], "--batch-size"),
    (["--ratio", "3", "--fit-length", "0"], "--fit-length"),
    (["--ratio", "3", "--tune-length", "1.5"], "--tune-length"),
    (["--ratio", "3", "--task-tolerance", "-1"], "--task-tolerance"),
    (["--ratio", "3", "--task-tolerance", "inf"], "--task-tolerance"),
    (["--ratio", "3", "--prefill", "slow"], "--prefill"),
    (["--ratio", "3", "--selectors", "kvzip(reach=8)"], "reach= sets how far recon=local's queries look"),
    (["--ratio", "3", "--selectors", "kvzip(recon=exact,reach=8)"], "without recon=local it does nothing"),
    (["--ratio", "3", "--selectors", "kvzip(reach=0,recon=local)"], "reach"),
    (["--ratio", "3", "--selectors", "kvzip(heads=pooled,heads=union)"], "given twice"),
    (["--ratio", "3", "--selectors", ""], "--selectors"),
    (["--ratio", "3", "--stores", "snapkv"], "--stores"),
    (["--ratio", "3", "--stores", "select:snapkv@x2+int8"], "not a storage method"),
    (["--ratio", "3", "--tune-n", "1000000000"],
     "--tune-n must be <= 1000 (tuning instances are built up front), got 1000000000"),
    (["--ratio", "3", "--calib-tokens", "100000000000"], "--calib-tokens must be <= "),
    (["--ratio", "3", "--threads", "100000"], "--threads must be <= ")])
def test_bad_values_are_one_line_before_the_model_loads(tmp_path, capsys, extra, expect):
    """Refused before any model is needed: the model path does not exist."""
    rc, _, err = _run(["--model", tmp_path / "no-model", *SMALL, *extra, "--out", tmp_path / "p.json"], capsys)
    one_error(rc, err, "plan", expect)
    assert not (tmp_path / "p.json").exists()


def test_the_default_tune_length_holds_the_tuning_tasks(s260k, tmp_path, capsys, no_calibration):
    """``--seq-len 128`` alone works: the default --tune-length (128, from --seq-len) is raised to hold passkey's
    prompts (up to 160 tokens), within the model's 512 positions; the plan's report says which length it used."""
    out = tmp_path / "p.json"
    rc, _, err = _run(["--model", s260k, "--calib", str(CALIB), "--calib-tokens", "1024", "--tune-tokens", "256",
                       "--seq-len", "128", "--no-progress", "--ratio", "3", "--selectors", "snapkv", "--stores", "int8",
                       "--tune-tasks", "passkey", "--tune-n", "1", "--out", out, "--json", tmp_path / "r.json"], capsys)
    assert rc == 0, err
    length = json.loads((tmp_path / "r.json").read_text())["tasks"]["length"]
    assert 128 < length <= 512


def test_a_selector_argument_that_does_nothing_never_reaches_a_label():
    """``reach`` is read only by the local reconstruction: given without ``recon=local`` it is refused, so no
    label shows it; with ``recon=local`` it is kept and shown."""
    from kvsplice.planning.search import INT8, check_selector, selection
    from kvsplice.planning.spec import spec_label

    with pytest.raises(ValueError, match="does nothing"):
        check_selector("kvzip(reach=8)")
    assert "reach=8" in spec_label(selection(INT8, check_selector("kvzip(recon=local,reach=8)"), 0.5))


@pytest.mark.parametrize("name,text,expect", [
    ("empty.json", "", "--stores"),
    ("nested.json", "[" * 100000 + "]" * 100000, ""),
    ("twice.json", '{"name": "dense", "name": "kivi"}', "twice"),
    ("list.json", "[]", "JSON object"),
    ("unknown.json", '{"name": "nosuch"}', "nosuch"),
    ("selection.json", '{"name": "token_selection", "selector": "snapkv", "keep": 0.5}', "not a storage method"),
    ("missing.json", '{"name": "lowrank", "bases": "gone.safetensors"}', "not found")])
def test_damaged_and_hostile_store_spec_files_are_one_line(tmp_path, capsys, name, text, expect):
    spec = tmp_path / name
    spec.write_text(text)
    before = snapshot(tmp_path)
    rc, _, err = _run(["--model", tmp_path / "no-model", *SMALL, "--ratio", "3", "--stores", spec,
                       "--out", tmp_path / "p.json"], capsys)
    one_error(rc, err, "plan", expect)
    assert snapshot(tmp_path) == before


def test_a_read_only_destination_is_one_line(readonly_dir, tmp_path, capsys):
    rc, _, err = _run(["--model", tmp_path / "no-model", *SMALL, "--ratio", "3", "--out", readonly_dir / "p.json"],
                      capsys)
    one_error(rc, err, "plan", "cannot write")


def test_calib_stats_is_written_exactly_when_the_help_says(s260k, tmp_path, capsys):
    """The help: the statistics are of the low-rank stores, written when --stores has one; with none (``--stores
    int8``) nothing is calibrated, the file is not written and a note says so — and the plan does not claim it."""
    helptext = " ".join(plan_cli.build_parser().format_help().split())
    assert "neither read nor written" in helptext and "when --stores has a low-rank store" in helptext
    stats, out = tmp_path / "NEW.safetensors", tmp_path / "p.json"
    rc, _, err = _run(["--model", s260k, *FAST, "--calib-stats", stats, "--out", out], capsys)
    assert rc == 0, err
    assert not stats.exists() and "note: --calib-stats" in err and "neither read nor written" in err
    assert json.loads(out.read_text())["calibration"]["stats_file"] is None


def test_ctrl_c_during_a_force_plan_leaves_the_earlier_outputs(s260k, tmp_path, capsys, monkeypatch):
    """Ctrl-C while ``plan --out P --json R --force`` searches: exit 130, one line, P, its bases and R as they
    were; the same run to the end replaces P and R."""
    import kvsplice.planning.search as search_mod

    out, report = tmp_path / "p.json", tmp_path / "r.json"
    for f in (out, report, tmp_path / "p.bases.safetensors"):
        f.write_bytes(os.urandom(64))
    before = snapshot(tmp_path)
    real = search_mod.search

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(search_mod, "search", interrupted)
    rc, _, err = _run(["--model", s260k, *FAST, "--out", out, "--json", report, "--force"], capsys)
    assert rc == 130 and err.strip().splitlines()[-1] == "kvsplice plan: interrupted", err
    assert snapshot(tmp_path) == before
    monkeypatch.setattr(search_mod, "search", real)
    rc, _, err = _run(["--model", s260k, *FAST, "--out", out, "--json", report, "--force"], capsys)
    assert rc == 0, err
    assert json.loads(out.read_text())["format"] == "kvsplice-plan" and "candidates" in json.loads(report.read_text())


class _Blob:
    """An in-memory object a plan writes beside itself (as it writes low-rank bases)."""

    def __init__(self, data: bytes):
        self.data = data

    def save(self, path):
        Path(path).write_bytes(self.data)


def test_an_interrupted_plan_save_leaves_no_plan_beside_other_bases(tmp_path):
    """Plan.save writes the plan, its bases and the report at temporary names and renames them together: stopped
    before the renames, every earlier file is as it was and no temporary is left (never a new bases file beside the
    old plan)."""
    from kvsplice.planning.spec import Plan

    out, report = tmp_path / "p.json", tmp_path / "r.json"
    Plan({"name": "lowrank", "bases": _Blob(b"old")}, "fp").save(out, also={report: lambda t: t.write_text("old")})
    before = snapshot(tmp_path)
    assert before["p.bases.safetensors"] and json.loads(out.read_text())["spec"]["bases"] == "p.bases.safetensors"

    def stop(tmp):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Plan({"name": "lowrank", "bases": _Blob(b"new")}, "fp2").save(out, also={report: stop})
    assert snapshot(tmp_path) == before
    Plan({"name": "lowrank", "bases": _Blob(b"new")}, "fp2").save(out, also={report: lambda t: t.write_text("new")})
    assert (tmp_path / "p.bases.safetensors").read_bytes() == b"new" and report.read_text() == "new"
    assert json.loads(out.read_text())["model_fingerprint"] == "fp2"


def test_ctrl_c_during_the_renames_is_held_until_all_are_done(tmp_path, monkeypatch):
    """A SIGINT raised while the staged outputs are renamed is held: every output is replaced, then
    ``KeyboardInterrupt`` (the signal is raised synchronously in this thread: no dependence on delivery)."""
    from kvsplice.io import staged as staged_mod

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("old a")
    b.write_text("old b")
    real = os.replace
    sent = []

    def replace(src, dst):
        if not sent:
            sent.append(1)
            signal.raise_signal(signal.SIGINT)
        real(src, dst)

    monkeypatch.setattr(staged_mod.os, "replace", replace)
    handler = signal.getsignal(signal.SIGINT)
    st = staged_mod.Staged([a, b])
    st.temp(a).write_text("new a")
    st.temp(b).write_text("new b")
    with pytest.raises(KeyboardInterrupt):
        st.commit()
    assert sent and a.read_text() == "new a" and b.read_text() == "new b"
    assert signal.getsignal(signal.SIGINT) is handler  # the command's own handler back in place
