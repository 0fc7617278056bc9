"""The method registry, its builder and its short form (``kvsplice.core.registry``, ``.build``, ``.short_form``):
every registered method and selector rebuilds from its ``spec()``; the short form parses to the dict form and back;
files are read relative to the spec's folder; a ``keep`` fraction becomes the budget of the prompt it is built for;
bad specs are one line naming the known names."""

from __future__ import annotations

import pytest
import torch

from kvsplice.core.build import build_method, build_selector
from kvsplice.core.registry import ALIASES, METHODS, SELECTORS, MethodSpecError, method_names, register, selector_names
from kvsplice.core.short_form import format_spec, parse_spec
from kvsplice.lowrank.joint import JointBases
from tests.tiny_models import orthonormal_bases
from hostile import prog_of


def _instances(tmp_path) -> dict[str, object]:
    """One method of every registered name, with arguments away from the defaults where it has any."""
    bases = orthonormal_bases(2, 2, 8, 3, "post")
    bases.save(tmp_path / "b.safetensors")
    joint = JointBases([{n: torch.randn(16, 4) for n in ("k_enc", "k_dec", "v_enc", "v_dec")} for _ in range(2)],
                       "post", 2)
    joint.save(tmp_path / "j.safetensors")
    return {
        "dense": build_method("int8"),
        "model": build_method("model"),
        "kivi": build_method("kivi(bits=2,group=16,residual=32)"),
        "kivi_rotated": build_method("kivi_rotated(bits=4,residual=16)"),
        "kivi_prerope": build_method("kivi_prerope(bits=2,group=16,residual=32)"),
        "lowrank": build_method("lowrank:b.safetensors+int8", base_dir=tmp_path),
        "joint-lowrank": build_method({"name": "joint-lowrank", "bases": str(tmp_path / "j.safetensors")}),
        "fd-online": build_method("fd-online(rank_k=3,ell=8,max_chunk_len=32)"),
        "token_selection": build_method("select:snapkv(window=8,kernel=3)@0.5+kivi4", prompt_len=40),
        "kvzip": build_method("select:kvzip(chunk=64)@0.25+int8", prompt_len=40),
    }


def test_every_registered_method_rebuilds_from_its_spec(tmp_path):
    made = _instances(tmp_path)
    builtin = {n for n, c in METHODS.items() if c.__module__.startswith("kvsplice.")}
    assert builtin == set(made), "give every built-in method an instance here"
    for name, m in made.items():
        spec = m.spec()
        assert spec["name"] == name == type(m).name
        again = build_method(spec)
        assert type(again) is type(m) and again.spec() == spec and repr(again) == repr(m), name


def test_every_registered_selector_rebuilds_from_its_spec():
    for name in selector_names():
        cls = SELECTORS[name]
        sel = cls(seed=3)
        spec = sel.spec()
        assert spec["name"] == name and spec["seed"] == 3
        again = build_selector(spec)
        assert type(again) is cls and again.spec() == spec and repr(again) == repr(sel)


def test_the_short_form_and_the_dict_form_agree():
    spec = parse_spec("select:observed_attention@0.25+int8")
    assert spec == {"name": "token_selection", "selector": {"name": "observed_attention"}, "keep": 0.25,
                    "store": {"name": "dense", "cache_quant": "int8"}}
    assert parse_spec("select:knorm(n_sink=2)@64+lowrank:r4.safetensors+int8") == {
        "name": "token_selection", "selector": {"name": "knorm", "n_sink": 2}, "budget": 64,
        "store": {"name": "lowrank", "bases": "r4.safetensors", "cache_quant": "int8"}}
    assert parse_spec("kivi4") == {"name": "kivi", "bits": 4}
    assert parse_spec("select:uniform@25%")["keep"] == 0.25
    assert parse_spec("select:uniform@x4")["keep"] == 0.25  # a ratio: keep 1/4
    assert parse_spec("kivi4h(residual=32)") == {"name": "kivi_rotated", "bits": 4, "residual": 32}
    assert parse_spec("kivi4p(residual=32)") == {"name": "kivi_prerope", "bits": 4, "residual": 32}
    assert parse_spec("select:snapkv@x2+kivi2(residual=16)")["store"] == {"name": "kivi", "bits": 2, "residual": 16}
    assert parse_spec('{"name": "kivi", "bits": 2}') == {"name": "kivi", "bits": 2}
    for text in ("select:observed_attention@0.25+int8", "select:snapkv(window=32)@64+kivi(bits=2,residual=32)",
                 "select:kvzip(chunk=64)@0.25+kivi_rotated(bits=4,residual=32)",
                 "lowrank:r4.safetensors+int8", "fd-online(rank_k=4,ell=8,relative=true)", "dense", "int8"):
        assert format_spec(parse_spec(text)) == text
        assert parse_spec(format_spec(parse_spec(text))) == parse_spec(text)


def test_keep_is_a_fraction_of_the_prompt_and_budget_is_tokens():
    assert build_method("select:snapkv@0.25", prompt_len=100).budget == 25
    assert build_method("select:snapkv@0.25", prompt_len=10).budget == 3  # ceil
    assert build_method("select:snapkv@0.001", prompt_len=10).budget == 1  # at least one token
    assert build_method("select:snapkv@7").budget == 7
    with pytest.raises(MethodSpecError, match="prompt length"):
        build_method("select:snapkv@0.25")
    with pytest.raises(MethodSpecError, match="not both"):
        build_method({"name": "token_selection", "selector": "snapkv", "keep": 0.5, "budget": 3}, prompt_len=8)


def test_files_are_read_relative_to_the_spec_folder(tmp_path):
    orthonormal_bases(2, 2, 8, 3, "post").save(tmp_path / "r3.safetensors")
    m = build_method("lowrank:r3.safetensors", base_dir=tmp_path)
    assert m.bases.ranks()["k"] == [[3, 3], [3, 3]]
    assert m.spec()["bases"] == str((tmp_path / "r3.safetensors").resolve())
    with pytest.raises(FileNotFoundError):
        build_method("lowrank:r3.safetensors", base_dir=tmp_path / "elsewhere")


@pytest.mark.parametrize("spec, match", [
    ("nosuch", "unknown method 'nosuch'.*dense.*kivi.*token_selection"),
    ("select:nosuch@4", "unknown selector 'nosuch'.*snapkv"),
    ("kivi(bitz=3)", "kivi takes bits, group, residual; got bitz"),
    ("kivi4+int9", r"only modifier is \+int8"),
    ("kivi:file.bin", "kivi takes no file"),
    ("select:snapkv", "select:SELECTOR@AMOUNT"),
    ("select:snapkv@x", "select:SELECTOR@AMOUNT"),
    ("select:snapkv@x0", "or a ratio"),
    ("{oops", "not valid JSON"),
    ({"bits": 4}, "a dict with a \"name\""),
    ("token_selection", "token_selection needs selector, budget"),
    ("", "the method spec is empty"),
    ("   ", "the method spec is empty"),
    ("select:kvzip(heads=pooled,heads=union)@x4", "heads given twice"),
    ("select:kvzip(keep=0.5)@x4", "keep given twice"),
    ("kivi4(bits=2)", "bits given twice"),
    ("int8+int8", "cache_quant given twice"),
    ("lowrank:a.safetensors(bases=b.safetensors)", "bases given twice"),
    ('{"name": "kivi", "bits": 2, "bits": 4}', "'bits' twice"),
])
def test_bad_specs_are_one_line_naming_what_is_known(spec, match):
    with pytest.raises(MethodSpecError, match=match) as e:
        build_method(spec)
    assert "\n" not in str(e.value)


def test_the_constructors_check_the_values():
    with pytest.raises(ValueError, match="bits must be one of"):
        build_method("kivi(bits=3)")


def test_kvzip_share_needs_mix():
    """``share`` is the part of the budget ``mix`` keeps: without ``mix`` it is refused, never dropped; with it, the
    given share (or the default) is what the scorer keeps, and the spec round-trips."""
    from kvsplice.select.kvzip import DEFAULT_SHARE

    with pytest.raises(ValueError, match="give mix= too"):
        build_method("select:kvzip(share=0.5)@x4", prompt_len=64)
    m = build_method("select:kvzip(mix=observed_attention,share=0.25)@x4", prompt_len=64)
    assert m._scorer().share == 0.25 and build_method(m.spec())._scorer().share == 0.25
    d = build_method("select:kvzip(mix=observed_attention)@x4", prompt_len=64)
    assert d._scorer().share == DEFAULT_SHARE and "share" not in d.spec()


def test_a_spec_file_with_a_repeated_key_is_refused(tmp_path):
    from kvsplice.core.short_form import load_spec

    f = tmp_path / "s.json"
    f.write_text('{"name": "token_selection", "selector": {"name": "snapkv", "window": 4, "window": 8}, "budget": 4}')
    with pytest.raises(MethodSpecError, match="'window' twice"):
        load_spec(str(f))


def test_one_name_one_meaning():
    assert not set(method_names()) & set(selector_names())
    assert not set(ALIASES) & (set(METHODS) | set(SELECTORS))

    class Imposter:
        name = "snapkv"

    with pytest.raises(TypeError, match="has that name"):
        register("method", Imposter)
    Imposter.name = "int8"
    with pytest.raises(TypeError, match="alias"):
        register("method", Imposter)


def test_every_method_module_of_the_package_is_loaded_by_name():
    """A method or selector class anywhere in the package registers with ``build_method`` without its module being
    imported first: its module is in ``BUILTIN_MODULES``."""
    import importlib
    from pathlib import Path

    from kvsplice.core.registry import BUILTIN_MODULES

    root = Path(__file__).resolve().parents[3]
    for pkg in ("core", "decode", "lowrank", "select", "quant", "online", "hf", "planning", "evaluation"):
        for path in sorted((root / "kvsplice" / pkg).glob("*.py")):
            importlib.import_module(".".join(path.relative_to(root).with_suffix("").parts))
    for cls in [*METHODS.values(), *SELECTORS.values()]:
        if cls.__module__.startswith("kvsplice."):
            assert cls.__module__ in BUILTIN_MODULES, f"add {cls.__module__} to BUILTIN_MODULES"


def test_a_spec_is_checked_before_it_is_built(tmp_path):
    from kvsplice.core.build import check_spec

    assert check_spec("select:snapkv@0.25+kivi4")["keep"] == 0.25  # no prompt length needed to check
    for bad, match in (("select:nosuch@4", "unknown selector"), ("select:snapkv(windo=3)@4", "snapkv takes"),
                       ("select:snapkv@4+kivi(bitz=2)", "kivi takes"), ("lowrank:nope.safetensors", "not found"),
                       ("nosuch", "unknown method")):
        with pytest.raises(MethodSpecError, match=match):
            check_spec(bad, base_dir=tmp_path)


def test_a_dict_spec_may_name_an_alias(tmp_path):
    """``{"name": "int8"}`` was refused as "unknown method 'int8' ... known: ..., int8, ...": a dict
    naming an alias is the alias's spec, its own arguments over it — in a spec file and nested as a store."""
    from kvsplice.core.build import check_spec
    from kvsplice.core.short_form import load_spec

    assert check_spec({"name": "int8"}) == {"name": "dense", "cache_quant": "int8"}
    assert build_method({"name": "kivi4", "residual": 32}).spec() == build_method("kivi4(residual=32)").spec()
    f = tmp_path / "s.json"
    f.write_text('{"name": "token_selection", "selector": {"name": "snapkv"}, "budget": 4, "store": {"name": "int8"}}')
    spec, base = load_spec(str(f))
    assert build_method(check_spec(spec, base_dir=base)).spec() == build_method("select:snapkv@4+int8").spec()
    with pytest.raises(MethodSpecError, match="unknown selector 'int8'"):  # an alias names a method, not a selector
        build_selector({"name": "int8"})


@pytest.mark.parametrize("tool, argv, needle", [
    ("generate", ["--prompt", "hi", "--max-new-tokens", "2", "--method", "nosuch"], "unknown method 'nosuch'"),
    ("generate", ["--prompt", "hi", "--max-new-tokens", "2", "--method", ""], "the method spec is empty"),
    ("eval_bases", ["--data", "x.txt", "--method", "select:snapkv(windo=2)@4"], "snapkv takes"),
    ("plan", ["--calib", "x.txt", "--ratio", "2", "--out", "{tmp}/p.json", "--stores", "kivi4", "model"],
     "model is not a storage method"),
])
def test_command_lines_check_a_spec_before_the_model_loads(tool, argv, needle, tmp_path, capsys):
    import importlib

    main = importlib.import_module(f"kvsplice.cli.{tool}").main
    (tmp_path / "x.txt").write_text("Once upon a time.\n")  # a text that exists: the spec is what is wrong
    argv = [a.replace("{tmp}", str(tmp_path)).replace("x.txt", str(tmp_path / "x.txt")) for a in argv]
    assert main(["--model", str(tmp_path / "no-such-model"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog_of(tool)}: error:") and needle in err[0], err
    assert not (tmp_path / "p.json").exists()
