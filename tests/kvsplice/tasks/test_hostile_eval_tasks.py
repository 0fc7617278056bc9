"""Hostile input to ``eval_tasks`` on stories260K: bad numbers, damaged and hostile spec and plan files, a read-only
destination, a hand-edited result resumed, and Ctrl-C during a ``--force`` run — each refused in one line (exit 2)
or interrupted in one line (exit 130), and no earlier result is ever lost or half-replaced."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hostile import one_error, readonly_dir, run_tool, s260k, snapshot  # noqa: F401  (readonly_dir, s260k: fixtures)
from kvsplice.cli import eval_tasks

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"

pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(),
                                reason=f"stories260K not found under {DATA}")

KIVI = "kivi(bits=4,group=8)"  # stories260K's heads have 8 dims
RUN = ["--method", "int8", "--tasks", "passkey", "--lengths", "160", "--n", "2", "--setting", "agnostic",
       "--no-progress"]


@pytest.fixture(scope="module")
def finished(s260k, tmp_path_factory) -> Path:
    """A complete result: 2 passkey instances, int8 beside the full cache."""
    out = tmp_path_factory.mktemp("r") / "r.json"
    assert eval_tasks.main(["--model", s260k, *RUN, "--out", str(out)]) == 0
    return out


def _run(argv, capsys):
    return run_tool(eval_tasks.main, argv, capsys)


@pytest.mark.parametrize("change,expect", [
    (["--n", "0"], "--n"), (["--n", "-3"], "--n"), (["--n", "1e9"], "--n"), (["--lengths", "0"], "--lengths"),
    (["--lengths", "nan"], "--lengths"), (["--lengths", "64"], "passkey at length 64 builds prompts"),
    (["--lengths", "100000"], "exceeds the model's"), (["--seed0", "-1"], "--seed0"),
    (["--seed0", "999999"], "--seed0"), (["--threads", "0"], "--threads"), (["--setting", "both3"], "--setting"),
    (["--tasks", "nosuch"], "--tasks"), (["--door", "x"], "--door"),
    (["--threads", "100000"], "--threads must be <= "), (["--device", "bogus"], "--device bogus")])
def test_bad_numbers_are_one_line_and_write_nothing(s260k, tmp_path, capsys, change, expect):
    out = tmp_path / "r.json"
    argv = list(RUN)
    for i in range(0, len(change), 2):
        if change[i] in argv:
            argv[argv.index(change[i]) + 1] = change[i + 1]
        else:
            argv += change[i:i + 2]
    rc, _, err = _run(["--model", s260k, *argv, "--out", out], capsys)
    one_error(rc, err, "eval_tasks", expect)
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("name,text,expect", [
    ("empty.json", "", "--method"),
    ("list.json", "[1, 2]", "--method"),
    ("nested.json", "[" * 100000 + "]" * 100000, ""),
    ("twice.json", '{"name": "dense", "name": "kivi"}', "twice"),
    ("unknown.json", '{"name": "nosuch"}', "nosuch"),
    ("badarg.json", '{"name": "kivi", "bits": 3.5}', "bits"),
    ("missing_bases.json", '{"name": "lowrank", "bases": "gone.safetensors"}', "not found"),
    ("escape_plan.json", json.dumps({"format": "kvsplice-plan", "version": 2, "spec": {"name": "lowrank", "bases":
                                                                                        "../../etc/passwd"}}), ""),
    ("plan_no_fp.json", json.dumps({"format": "kvsplice-plan", "version": 2, "spec": {"name": "kivi", "bits": 4}}),
     "model_fingerprint")])
def test_damaged_and_hostile_spec_files_are_one_line(s260k, tmp_path, capsys, name, text, expect):
    spec = tmp_path / name
    spec.write_text(text)
    out = tmp_path / "r.json"
    before = snapshot(tmp_path)
    rc, _, err = _run(["--model", s260k, "--method", spec, "--tasks", "passkey", "--lengths", "160", "--n", "1",
                       "--no-progress", "--out", out], capsys)
    one_error(rc, err, "eval_tasks", expect)
    assert snapshot(tmp_path) == before  # the spec file left alone, no result written


def test_a_hostile_plan_option_is_one_line(s260k, tmp_path, capsys):
    for text in ("{", '{"format": "kvsplice-plan", "version": 99}', '"just a string"'):
        plan = tmp_path / "p.json"
        plan.write_text(text)
        rc, _, err = _run(["--model", s260k, "--plan", plan, *RUN[2:], "--out", tmp_path / "r.json"], capsys)
        one_error(rc, err, "eval_tasks")
    assert not (tmp_path / "r.json").exists()


def test_a_read_only_destination_is_one_line(s260k, readonly_dir, capsys):
    rc, _, err = _run(["--model", s260k, *RUN, "--out", readonly_dir / "r.json"], capsys)
    one_error(rc, err, "eval_tasks", "cannot write")


def test_a_hand_edited_score_is_rescored_from_its_output_on_resume(s260k, finished, tmp_path, capsys):
    """The file holds outputs; scores are derived from them. A result whose recorded output is not the passkey but
    whose score was edited to 1.0 is re-scored on resume (a note says so), in the file and its summary."""
    from kvsplice.tasks.instance import match_score

    out = tmp_path / "r.json"
    doc = json.loads(finished.read_text())
    edited = []
    for key, outs in doc["results"]["agnostic"].items():
        for m, o in outs.items():
            if o["score"] < 1.0:
                o["score"] = 1.0
                edited.append((key, m, o["output"]))
    assert edited, "stories260K answered every passkey: nothing to hand-edit"
    out.write_text(json.dumps(doc))
    rc, _, err = _run(["--model", s260k, *RUN, "--out", out], capsys)
    assert rc == 0, err
    assert "re-scored" in err and "note:" in err
    after = json.loads(out.read_text())
    for key, m, output in edited:
        assert after["results"]["agnostic"][key][m]["score"] < 1.0
        assert after["results"]["agnostic"][key][m]["output"] == output  # nothing re-run: the output is kept
    summary = after["summary"]["agnostic"]
    assert json.dumps(summary) == json.dumps(json.loads(finished.read_text())["summary"]["agnostic"])
    assert match_score("the pass key is 12345", ["12345"]) == 1.0


def test_ctrl_c_during_a_force_run_leaves_the_earlier_result(s260k, finished, tmp_path, capsys, monkeypatch):
    """Ctrl-C in the middle of ``--out X --force`` (after the first instance's progress was saved): exit 130, one
    line, X byte-identical to the complete earlier result and no temporary left; the same run to the end replaces
    it."""
    import kvsplice.tasks.shared as shared

    out = tmp_path / "r.json"
    shutil.copy(finished, out)
    before = out.read_bytes()
    real, calls = shared.answer_many, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # the first instance answered and saved as progress, then Ctrl-C
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(shared, "answer_many", interrupted)
    rc, _, err = _run(["--model", s260k, *RUN, "--method", KIVI, "--out", out, "--force"], capsys)
    assert rc == 130 and err.strip().splitlines()[-1] == "kvsplice eval-tasks: interrupted", err
    assert out.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and not p.name.endswith(".claim")]
    monkeypatch.setattr(shared, "answer_many", real)
    rc, _, err = _run(["--model", s260k, *RUN, "--method", KIVI, "--out", out, "--force"], capsys)
    assert rc == 0, err
    doc = json.loads(out.read_text())
    assert all(set(o) == {"full", KIVI} for o in doc["results"]["agnostic"].values())
