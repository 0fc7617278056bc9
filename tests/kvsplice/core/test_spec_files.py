"""The files a method spec names are inputs of the run (:mod:`kvsplice.core.spec_files`, :class:`SpecArgs` in
:mod:`kvsplice.io.inputs`): with ``--force``, ``--json`` / ``--out`` / ``--md`` naming the bases file of
``--method lowrank:B`` (or ``plan --stores lowrank:B``), a ``--method spec.json`` itself, a bases file that spec names,
or the plan of ``eval_tasks --method plan:P`` replaced that file. Each is now one ``PROG: error: ...`` line, exit 2,
and the file is left byte-identical — refused before any model loads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hostile import one_error, snapshot
from kvsplice.cli import eval_bases, eval_tasks, generate, plan
from kvsplice.core.spec_files import argument_files, document_files, rebased, spec_files


@pytest.fixture
def d(tmp_path: Path, monkeypatch) -> Path:
    """A folder (the working directory) with a bases file, a spec file naming a bases file beside it, a plan and a
    calibration text; nothing here is a valid model — every refusal comes before a model is needed."""
    (tmp_path / "b.safetensors").write_bytes(os.urandom(256))
    (tmp_path / "q.bases.safetensors").write_bytes(os.urandom(256))  # where plan --out q.json writes its bases
    sub = tmp_path / "specs"
    sub.mkdir()
    (sub / "inner.safetensors").write_bytes(os.urandom(256))
    (sub / "spec.json").write_text(json.dumps({"name": "token_selection", "selector": {"name": "snapkv"},
                                               "keep": 0.5, "store": {"name": "lowrank",
                                                                      "bases": "inner.safetensors"}}))
    (tmp_path / "p.json").write_text(json.dumps({"format": "kvsplice-plan", "version": 2, "spec": {"name": "kivi",
                                                                                                  "bits": 4}}))
    (tmp_path / "calib.txt").write_text("Once upon a time there was a cat. " * 50)
    monkeypatch.chdir(tmp_path)
    return tmp_path


MODEL = ["--model", "no_model_here"]
GEN = ["--prompt", "hi", "--max-new-tokens", "2"]
PLAN = ["--calib", "calib.txt", "--ratio", "4"]

# (tool, prog, arguments): each names an input as an output, with --force
CASES = [
    (generate, "generate", [*GEN, "--method", "lowrank:b.safetensors", "--json", "b.safetensors"]),
    (generate, "generate", [*GEN, "--method", "select:snapkv@x4+lowrank:b.safetensors", "--json", "b.safetensors"]),
    (generate, "generate", [*GEN, "--method", "specs/spec.json", "--json", "specs/spec.json"]),
    (generate, "generate", [*GEN, "--method", "specs/spec.json", "--json", "specs/inner.safetensors"]),
    (generate, "generate", [*GEN, "--method", "p.json", "--json", "p.json"]),
    (eval_bases, "eval_bases", ["--data", "calib.txt", "--method", "lowrank:b.safetensors", "--json",
                                "b.safetensors"]),
    (eval_bases, "eval_bases", ["--data", "calib.txt", "--method", "specs/spec.json", "--json", "specs/spec.json"]),
    (eval_bases, "eval_bases", ["--data", "calib.txt", "--method", "specs/spec.json", "--json",
                                "specs/inner.safetensors"]),
    (eval_tasks, "eval_tasks", ["--method", "lowrank:b.safetensors", "--out", "b.safetensors"]),
    (eval_tasks, "eval_tasks", ["--method", "lowrank:b.safetensors", "--out", "r.json", "--md", "b.safetensors"]),
    (eval_tasks, "eval_tasks", ["--method", "specs/spec.json", "--out", "specs/spec.json"]),
    (eval_tasks, "eval_tasks", ["--method", "specs/spec.json", "--out", "r.json", "--md", "specs/spec.json"]),
    (eval_tasks, "eval_tasks", ["--method", "specs/spec.json", "--out", "specs/inner.safetensors"]),
    (eval_tasks, "eval_tasks", ["--method", "plan:p.json", "--out", "p.json"]),
    (eval_tasks, "eval_tasks", ["--plan", "p.json", "--out", "p.json"]),
    (plan, "plan", [*PLAN, "--stores", "lowrank:b.safetensors", "--out", "b.safetensors"]),
    (plan, "plan", [*PLAN, "--stores", "lowrank:b.safetensors", "--out", "q.json", "--json", "b.safetensors"]),
    (plan, "plan", [*PLAN, "--stores", "specs/spec.json", "--out", "specs/inner.safetensors"]),
    (plan, "plan", [*PLAN, "--stores", "lowrank:q.bases.safetensors", "--out", "q.json"]),
]


@pytest.mark.parametrize("tool,prog,args", CASES, ids=[" ".join(a[-4:]) for _, _, a in CASES])
def test_no_output_replaces_a_file_a_spec_names(tool, prog, args, d, capsys):
    if tool is plan and "specs/spec.json" in args:  # a spec file of a storage method: plan takes .json specs too
        (d / "specs" / "spec.json").write_text(json.dumps({"name": "lowrank", "bases": "inner.safetensors"}))
    before = snapshot(d)
    rc = tool.main([*MODEL, *args, "--force"])
    one_error(rc, capsys.readouterr().err, prog, "input")
    assert snapshot(d) == before


def test_spec_files_walks_nested_specs_and_resolves_like_build_method(tmp_path):
    spec = {"name": "token_selection", "selector": {"name": "snapkv"}, "keep": 0.5,
            "store": "lowrank:~/b.safetensors+int8"}
    assert spec_files(spec) == [("bases", Path("~/b.safetensors").expanduser().resolve())]
    assert spec_files({"name": "lowrank", "bases": "x.safetensors"}, tmp_path) == [("bases",
                                                                                  tmp_path / "x.safetensors")]
    joint = {"name": "joint-lowrank", "bases": "/abs/j.safetensors"}
    assert spec_files(joint) == [("bases", Path("/abs/j.safetensors"))]
    assert spec_files("kivi4") == spec_files("not a spec ((") == spec_files({"name": "nope", "bases": "x"}) == []


def test_document_files_reads_plans_of_both_versions_and_spec_files(tmp_path):
    v1 = tmp_path / "v1.json"
    v1.write_text(json.dumps({"format": "kvsplice-plan", "version": 1, "stack": {"store": "lowrank"},
                              "bases": "v1.bases.safetensors"}))
    v2 = tmp_path / "v2.json"
    v2.write_text(json.dumps({"format": "kvsplice-plan", "version": 2,
                              "spec": {"name": "token_selection", "keep": 0.5, "selector": {"name": "snapkv"},
                                       "store": {"name": "lowrank", "bases": "v2.bases.safetensors"}}}))
    (tmp_path / "bad.json").write_text("{not json")
    assert document_files(v1) == [("bases", tmp_path / "v1.bases.safetensors")]
    assert document_files(v2) == [("bases", tmp_path / "v2.bases.safetensors")]
    assert document_files(tmp_path / "bad.json") == document_files(tmp_path / "missing.json") == []
    assert argument_files(f"plan:{v2}") == (v2, [("bases", tmp_path / "v2.bases.safetensors")])
    assert argument_files(str(v1)) == (v1, [("bases", tmp_path / "v1.bases.safetensors")])
    assert argument_files("int8") == (None, [])


def test_rebased_names_a_spec_files_files_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = {"name": "token_selection", "keep": 0.5, "selector": {"name": "snapkv"},
            "store": "lowrank:inner.safetensors+int8"}
    out = rebased(spec, tmp_path / "specs")
    assert out["store"] == {"name": "lowrank", "bases": os.path.join("specs", "inner.safetensors"),
                            "cache_quant": "int8"}
    assert spec["store"] == "lowrank:inner.safetensors+int8"  # a copy


def test_plan_store_specs_read_a_spec_file_relative_to_its_folder(d):
    """``plan --stores spec.json`` was refused though ``--method`` takes ``.json`` specs everywhere."""
    (d / "specs" / "store.json").write_text(json.dumps({"name": "lowrank", "bases": "inner.safetensors",
                                                        "cache_quant": "int8"}))
    (d / "specs" / "int8.json").write_text(json.dumps({"name": "int8"}))
    assert plan._store_specs(["specs/store.json", "specs/int8.json", "kivi4"]) == [
        {"name": "lowrank", "bases": os.path.join("specs", "inner.safetensors"), "cache_quant": "int8"},
        {"name": "dense", "cache_quant": "int8"}, {"name": "kivi", "bits": 4}]
