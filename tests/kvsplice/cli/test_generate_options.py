"""``generate``'s options declared once (:class:`kvsplice.cli.generate.GenerateOptions`): the parser is built from
the dataclass's fields, a parsed command line is the dataclass, the library checks what the command checks, and a
library call (:func:`kvsplice.cli.generate.run`) generates what the command does."""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing

import pytest

from hostile import tiny_ckpt
from kvsplice.cli import generate
from kvsplice.cli.generate import GenerateOptions
from kvsplice.io.cli import UsageError
from kvsplice.io.options import flags_of, from_args, option_fields

BASE = ("--model", "m", "--prompt", "hi", "--max-new-tokens", "4")


def _parse(*argv: str) -> GenerateOptions:
    return from_args(GenerateOptions, generate.build_parser().parse_args(list(argv)))


def test_the_command_line_is_the_dataclass_with_its_defaults():
    assert _parse(*BASE) == GenerateOptions(model="m", prompt="hi", max_new_tokens=4)
    o = _parse(*BASE, "--select", "uniform", "--budget", "8", "--temperature", "0.5", "--top-k", "3", "--seed", "2",
               "--json", "g.json", "--force", "--dtype", "bf16", "--device", "cpu")
    assert (o.select, o.budget, o.temperature, o.top_k, o.seed, o.json, o.force, o.dtype, o.device) == \
        ("uniform", 8, 0.5, 3, 2, "g.json", True, "bf16", "cpu")
    d = GenerateOptions(model="m", prompt="hi", max_new_tokens=4)
    assert (d.temperature, d.top_k, d.seed, d.dtype, d.method, d.json, d.force) == (0.0, None, 0, "fp32", None,
                                                                                     None, False)


def test_every_field_is_an_option_with_its_help():
    text = " ".join(generate.build_parser().format_help().split())
    assert {f.name for f, _ in option_fields(GenerateOptions)} == {f.name for f in dataclasses.fields(GenerateOptions)}
    for f, _ in option_fields(GenerateOptions):
        assert flags_of(f)[0] in text, f.name
    for part in ("[--method SPEC | --bases BASES | --select {", "--force replace an existing --json file",
                 "--temperature TEMPERATURE 0 (default): greedy", "--dtype {bf16,fp16,fp32}"):
        assert part in text, part


@pytest.mark.parametrize("extra, needle", [
    ({"select": "uniform"}, "--select needs --budget N"), ({"budget": 4}, "--budget is only used with --select"),
    ({"top_k": 3}, "--top-k samples: give --temperature > 0"), ({"prompt": "  "}, "--prompt is empty"),
    ({"max_new_tokens": 0}, "--max-new-tokens must be >= 1"),
    ({"temperature": float("nan")}, "--temperature must be a number in [0, 100]"),
    ({"temperature": 1e12}, "--temperature must be a number in [0, 100]"),
    ({"bases": "b", "plan": "p"}, "argument --plan: not allowed with argument --bases"),
])
def test_the_library_and_the_command_refuse_the_same_in_one_line(extra, needle):
    kw = {"model": "m", "prompt": "hi", "max_new_tokens": 4, **extra}
    with pytest.raises((UsageError, ValueError)) as lib:
        GenerateOptions(**kw)
    assert needle in str(lib.value), str(lib.value)
    argv = ["--model", "m", "--prompt", kw["prompt"], "--max-new-tokens", str(kw["max_new_tokens"])]
    for k, v in extra.items():
        if k not in ("prompt", "max_new_tokens"):
            argv += [f"--{k.replace('_', '-')}", str(v)]
    with pytest.raises((UsageError, ValueError)) as cmd:
        _parse(*argv)
    assert "\n" not in str(cmd.value), str(cmd.value)


def test_run_takes_the_options_object_not_a_namespace():
    hints = typing.get_type_hints(generate.run)
    assert hints["opts"] is GenerateOptions and list(inspect.signature(generate.run).parameters) == ["opts"]


def test_a_library_call_generates_what_the_command_does(tmp_path, capsys):
    ckpt = tiny_ckpt(tmp_path / "m.ckpt", tmp_path / "cache")
    opts = GenerateOptions(model=str(ckpt), prompt="Once upon a time", max_new_tokens=6, temperature=0.8, top_k=5,
                           seed=3, device="cpu")
    lib = generate.run(opts)
    assert generate.main(["--model", str(ckpt), "--prompt", "Once upon a time", "--max-new-tokens", "6",
                          "--temperature", "0.8", "--top-k", "5", "--seed", "3", "--device", "cpu", "--json",
                          str(tmp_path / "g.json")]) == 0
    cmd = json.loads((tmp_path / "g.json").read_text())
    assert len(lib["tokens"]) == 6 and lib["tokens"] == cmd["tokens"] and lib["cache_bytes"] == cmd["cache_bytes"]
