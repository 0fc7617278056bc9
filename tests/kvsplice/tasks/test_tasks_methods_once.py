"""``eval_tasks``' methods (:mod:`kvsplice.tasks.methods`): a ``--method`` spec file is opened once and the bases it
names are read once, however many prompts the method compresses; a method that does not depend on the prompt is
built once for every prompt, one that does (a ``keep`` fraction) once per prompt beside the one check build."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_models import orthonormal_bases

import kvsplice.tasks.methods as methods_mod
from kvsplice.lowrank.method import LowRank


def _counting(monkeypatch, target, name):
    calls = []
    real = getattr(target, name)

    def counted(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(target, name, counted)
    return calls


def test_a_spec_file_and_its_bases_are_read_once_and_a_fixed_method_built_once(tmp_path, monkeypatch):
    orthonormal_bases(2, 2, 8, 4, "post").save(tmp_path / "b.safetensors")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "lowrank", "bases": "b.safetensors", "cache_quant": "int8"}))
    reads = _counting(monkeypatch, Path, "read_text")
    loads = _counting(monkeypatch, LowRank, "load_spec_file")
    builds = _counting(monkeypatch, methods_mod, "build_method")
    m = methods_mod.parse_method(str(spec))
    ids = [torch.randint(3, 50, (1, n)) for n in (10, 20, 30)]
    made = [m.factory(x) for x in ids]
    assert sum(Path(a[0]) == spec for a in reads) == 1  # the spec file opened once
    assert len(loads) == 1  # its bases read once
    assert len(builds) == 1 and all(x is made[0] for x in made)  # one method for every prompt
    assert m.label.startswith("lowrank") and spec.resolve() in m.files and (tmp_path / "b.safetensors").resolve() \
        in m.files


def test_a_prompt_dependent_method_is_built_once_per_prompt(tmp_path, monkeypatch):
    orthonormal_bases(2, 2, 8, 4, "post").save(tmp_path / "b.safetensors")
    loads = _counting(monkeypatch, LowRank, "load_spec_file")
    builds = _counting(monkeypatch, methods_mod, "build_method")
    m = methods_mod.parse_method(f"select:snapkv@x2+lowrank:{tmp_path / 'b.safetensors'}")
    made = [m.factory(torch.randint(3, 50, (1, n))) for n in (10, 20, 30)]
    assert len(builds) == 1 + 3  # the check build, then one per prompt
    assert [x.budget for x in made] == [5, 10, 15] and len(loads) == 1  # the bases read once for all of them
