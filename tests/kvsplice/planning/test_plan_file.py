"""The plan file (``kvsplice.planning.spec.Plan``): it holds a method spec; version-1 files (a ``stack`` and a
``bases`` file) are read and converted; in-memory bases are written beside the plan and named relative to it; a
plan moved with its bases still loads; missing bases and foreign files are one-line ``PlanError``s."""

from __future__ import annotations

import json
import shutil

import pytest

from kvsplice.planning.spec import PLAN_FORMAT, PLAN_VERSION, Plan, PlanError, spec_label, stack_to_spec
from tests.tiny_models import orthonormal_bases


def _v1(tmp_path, stack: dict, bases: str | None = None):
    doc = {"format": PLAN_FORMAT, "version": 1, "model_fingerprint": None, "stack": stack, "bases": bases,
           "label": "old", "budget": {"bytes_per_token": 100.0}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    return path


def test_version_1_plans_are_converted(tmp_path):
    stack = {"store": "kivi", "bits": 2, "group": 16, "residual": 32, "lowrank_ratio": 1.0, "rope": "post",
             "cache_quant": None, "selector": "snapkv", "selector_kw": {"window": 8}, "keep": 0.25}
    plan = Plan.load(_v1(tmp_path, stack))
    assert plan.spec == {"name": "token_selection", "selector": {"name": "snapkv", "window": 8}, "keep": 0.25,
                         "store": {"name": "kivi", "bits": 2, "group": 16, "residual": 32}}
    m = plan.method(prompt_len=100)
    assert m.budget == 25 and (m.store.bits, m.store.group, m.store.residual) == (2, 16, 32)
    assert m.selector.window == 8 and plan.info["budget"] == {"bytes_per_token": 100.0}
    assert spec_label(plan.spec) == "snapkv(window=8)×4 + kivi2(g16,r32)"
    orthonormal_bases(2, 2, 8, 3, "post").save(tmp_path / "old.bases.safetensors")
    lr = Plan.load(_v1(tmp_path, {"store": "lowrank", "cache_quant": "int8"}, "old.bases.safetensors"))
    assert lr.spec == {"name": "lowrank", "bases": "old.bases.safetensors", "cache_quant": "int8"}
    assert lr.method().bases.ranks()["k"] == [[3, 3], [3, 3]]
    assert stack_to_spec({"store": "int8"}, None) == {"name": "dense", "cache_quant": "int8"}


def test_in_memory_bases_are_written_beside_the_plan_and_it_moves_with_them(tmp_path):
    bases = orthonormal_bases(2, 2, 8, 3, "post")
    spec = {"name": "token_selection", "selector": {"name": "knorm"}, "keep": 0.5,
            "store": {"name": "lowrank", "bases": bases, "cache_quant": "int8"}}
    Plan(spec, "fp", info={"note": 1}).save(tmp_path / "a" / "p.json")
    doc = json.loads((tmp_path / "a" / "p.json").read_text())
    assert doc["version"] == PLAN_VERSION == 2 and doc["spec"]["store"]["bases"] == "p.bases.safetensors"
    assert doc["note"] == 1 and doc["label"] == spec_label(spec)
    assert spec["store"]["bases"] is bases  # the caller's spec is not changed
    shutil.move(tmp_path / "a", tmp_path / "b")  # files are relative to the plan's folder
    plan = Plan.load(tmp_path / "b" / "p.json")
    m = plan.method(prompt_len=10)
    assert m.budget == 5 and m.store.cache_quant == "int8" and m.store.bases.ranks() == bases.ranks()
    assert plan.model_fingerprint == "fp" and plan.info == {"note": 1}
    (tmp_path / "b" / "p.bases.safetensors").unlink()
    with pytest.raises(PlanError, match="bases file .* is missing"):
        Plan.load(tmp_path / "b" / "p.json")


def test_foreign_files_and_bad_specs_are_plan_errors(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(PlanError, match="not a kvsplice plan"):
        Plan.load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text(json.dumps({"format": PLAN_FORMAT, "version": 2, "spec": ["kivi"]}))
    with pytest.raises(PlanError, match="not a method spec"):
        Plan.load(tmp_path / "y.json")
    with pytest.raises(PlanError, match="unknown method 'nosuch'"):
        Plan({"name": "nosuch"}).method()
    with pytest.raises(PlanError, match="store must be one of"):
        stack_to_spec({"store": "zip"}, None)
