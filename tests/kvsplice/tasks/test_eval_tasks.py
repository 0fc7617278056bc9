"""Tests for kvsplice eval-tasks on a real small model (stories260K, converted from llama2.c): the table and
JSON, both settings, resuming a finished run without recomputing, the HF door's tokens == the Decoder door's, and
one-line errors that leave files alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hostile import run_tool, s260k  # noqa: F401  (s260k: a fixture)
from kvsplice.cli import eval_tasks

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"

pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(),
                                reason=f"stories260K not found under {DATA}")

ARGS = ["--tasks", "passkey", "vartrack", "--lengths", "410", "--n", "2", "--no-progress"]
METHODS = ["--method", "int8", "select:observed_attention@x4+int8", "select:kvzip@x2"]


@pytest.fixture(scope="module")
def s260k_fp(s260k) -> str:
    """The model fingerprint of stories260K (a plan made for it records it)."""
    from kvsplice.adapters import model_fingerprint
    from kvsplice.loading import load_model

    return model_fingerprint(load_model(s260k).model)


def _run(argv, capsys):
    return run_tool(eval_tasks.main, argv, capsys)


def test_eval_tasks_table_json_and_resume(s260k, tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "r.json"
    rc, stdout, err = _run(["--model", s260k, *METHODS, *ARGS, "--out", out, "--md", tmp_path / "r.md"], capsys)
    assert rc == 0, err
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"agnostic", "aware"}
    for setting, by_inst in doc["results"].items():
        assert len(by_inst) == 4  # 2 tasks × 2 seeds
        for key, outs in by_inst.items():
            assert set(outs) == {"full", "int8", "select:observed_attention@x4+int8", "select:kvzip@x2"}
            for o in outs.values():
                assert o["cache_bytes"] == o["formula_bytes"] and 0 <= o["score"] <= 1
            assert outs["full"]["fp16_bytes"] == outs["full"]["full_fp16_bytes"]
            assert outs["select:kvzip@x2"]["fp16_bytes"] < outs["full"]["fp16_bytes"]
    s = doc["summary"]["agnostic"]
    assert s["full"]["n"] == 4 and s["full"]["ratio"] == pytest.approx(1.0)
    assert s["select:observed_attention@x4+int8"]["ratio"] > 4
    assert "| passkey/410 " in stdout and "**agnostic**" in stdout and (tmp_path / "r.md").is_file()

    def refuse(*a, **k):
        raise AssertionError("a finished instance was recomputed")

    monkeypatch.setattr("kvsplice.tasks.shared.answer_many", refuse)
    rc, stdout, err = _run(["--model", s260k, *METHODS, *ARGS, "--out", out], capsys)
    assert rc == 0, err
    assert json.loads(out.read_text())["results"] == doc["results"]


def test_eval_tasks_hf_door_matches_decoder(s260k, tmp_path, capsys) -> None:
    common = ["--model", s260k, "--method", "select:snapkv@0.5", "--tasks", "passkey", "--lengths", "160", "--n", "1",
              "--setting", "agnostic", "--no-progress"]
    assert _run([*common, "--out", tmp_path / "d.json"], capsys)[0] == 0
    assert _run([*common, "--door", "hf", "--out", tmp_path / "h.json"], capsys)[0] == 0
    d = json.loads((tmp_path / "d.json").read_text())["results"]["agnostic"]
    h = json.loads((tmp_path / "h.json").read_text())["results"]["agnostic"]
    for key in d:
        for m in d[key]:
            assert d[key][m]["tokens"] == h[key][m]["tokens"] and d[key][m]["cache_bytes"] == h[key][m]["cache_bytes"]


def test_eval_tasks_errors_are_one_line(s260k, tmp_path, capsys) -> None:
    other = tmp_path / "other.json"
    other.write_text('{"something": 1}')
    binary = tmp_path / "stories.txt"
    binary.write_bytes(bytes(range(256)) * 64)
    cases = [
        (["--model", s260k, "--method", "int8", *ARGS, "--stories", binary, "--out", tmp_path / "a.json"],
         "stories"),
        (["--model", s260k, *ARGS, "--out", tmp_path / "a.json"], "--plan"),
        (["--model", s260k, "--method", "kivi3", *ARGS, "--out", tmp_path / "a.json"], "unknown method 'kivi3'"),
        (["--model", s260k, "--method", "int8", *ARGS, "--out", other], "not an eval_tasks result"),
        (["--model", s260k, "--method", "int8", "--tasks", "story_qa", "--out", tmp_path / "a.json"], "--stories"),
        (["--model", s260k, "--method", "int8", *ARGS, "--lengths", "100000", "--out", tmp_path / "a.json"],
         "positions"),
        (["--model", s260k, "--method", "int8", *ARGS, "--lengths", "512", "--out", tmp_path / "a.json"],
         "answer tokens exceed the model's 512 positions"),  # a prompt filling the positions leaves none to answer
        (["--model", s260k, "--method", "int8", *ARGS, "--lengths", "64", "--out", tmp_path / "a.json"],
         "--lengths: passkey at length 64 builds prompts of up to 160 tokens"),
        (["--model", s260k, "--method", "", *ARGS, "--out", tmp_path / "a.json"], "--method is empty"),
    ]
    for argv, words in cases:
        rc, stdout, err = _run(argv, capsys)
        assert rc == 2 and err.count("\n") == 1 and err.startswith("kvsplice eval-tasks: error:") and words in err, err
    assert other.read_text() == '{"something": 1}' and not (tmp_path / "a.json").exists()


def test_eval_tasks_runs_a_plan_that_re_reads_its_prompt(s260k, s260k_fp, tmp_path, capsys) -> None:
    """A plan the planner may pick (KVzip over int8 rows) runs per prompt, as the same spec by --method does."""
    from kvsplice.planning.spec import Plan

    Plan({"name": "kvzip", "keep": 0.5, "store": {"name": "dense", "cache_quant": "int8"}}, s260k_fp).save(
        tmp_path / "p.json")
    common = ["--model", s260k, "--tasks", "passkey", "--lengths", "160", "--n", "1", "--setting", "agnostic",
              "--no-progress"]
    rc, _, err = _run([*common, "--plan", tmp_path / "p.json", "--method", "select:kvzip@0.5+int8", "--out",
                       tmp_path / "k.json"], capsys)
    assert rc == 0, err
    for outs in json.loads((tmp_path / "k.json").read_text())["results"]["agnostic"].values():
        plan, spec = outs[f"plan:{tmp_path / 'p.json'}"], outs["select:kvzip@0.5+int8"]
        assert plan["tokens"] == spec["tokens"] and plan["cache_bytes"] == spec["cache_bytes"] < outs["full"][
            "cache_bytes"]
    Plan({"name": "kvzip", "heads": "union", "keep": 0.25}, s260k_fp).save(tmp_path / "p.json")  # made again
    rc, _, err = _run([*common, "--plan", tmp_path / "p.json", "--out", tmp_path / "k.json"], capsys)
    assert rc == 0 and "its results are run again" in err
    doc = json.loads((tmp_path / "k.json").read_text())
    assert "heads=union" in doc["methods"][f"plan:{tmp_path / 'p.json'}"]
    for outs in doc["results"]["agnostic"].values():
        again, spec = outs[f"plan:{tmp_path / 'p.json'}"], outs["select:kvzip@0.5+int8"]
        assert again["cache_bytes"] != spec["cache_bytes"] and again["n_compressed"] == spec["n_compressed"]
        assert again["fp16_bytes"] < 0.3 * outs["full"]["fp16_bytes"]  # measured anew: a quarter of the prompt kept


def test_eval_tasks_checks_a_plans_model(s260k, s260k_fp, tmp_path, capsys) -> None:
    """A plan of another model, or one that does not say which, is refused by --plan and as a --method spec file
    (the check generate and eval_bases make); this model's plan runs either way."""
    from kvsplice.planning.spec import Plan

    common = ["--model", s260k, "--tasks", "passkey", "--lengths", "160", "--n", "1", "--setting", "agnostic",
              "--no-progress", "--out", tmp_path / "r.json"]
    spec = {"name": "token_selection", "selector": "snapkv", "keep": 0.5}
    other = Plan(spec, "llama-0000000000000000").save(tmp_path / "other.json")
    none = Plan(spec).save(tmp_path / "none.json")
    for option in ("--plan", "--method"):
        rc, _, err = _run([*common, option, other], capsys)
        assert rc == 2 and err.count("\n") == 1 and "made for model llama-0000000000000000" in err, err
        rc, _, err = _run([*common, option, none], capsys)
        assert rc == 2 and err.count("\n") == 1 and "records no model_fingerprint" in err, err
    assert not (tmp_path / "r.json").exists()
    mine = Plan(spec, s260k_fp).save(tmp_path / "mine.json")
    rc, _, err = _run([*common, "--method", mine], capsys)
    assert rc == 0, err
    outs = next(iter(json.loads((tmp_path / "r.json").read_text())["results"]["agnostic"].values()))
    assert outs[str(mine)]["cache_bytes"] < outs["full"]["cache_bytes"]
