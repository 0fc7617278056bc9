"""``to-gguf``'s options declared once (:class:`kvsplice.convert.gguf_options.ToGGUFOptions`): the parser is
built from the dataclass's fields (the folder a positional argument), a parsed command line is the dataclass."""

from __future__ import annotations

import dataclasses

import pytest

from kvsplice.cli import to_gguf
from kvsplice.convert.gguf_options import OUTTYPES, ToGGUFOptions
from kvsplice.io.cli import UsageError
from kvsplice.io.options import flags_of, from_args, option_fields


def _parse(*argv: str) -> ToGGUFOptions:
    return from_args(ToGGUFOptions, to_gguf.build_parser().parse_args(list(argv)))


def test_the_command_line_is_the_dataclass_with_its_defaults():
    assert _parse() == ToGGUFOptions()
    assert _parse("ds", "--out", "m.gguf", "--outtype", "q8_0", "--force") == \
        ToGGUFOptions(folder="ds", out="m.gguf", outtype="q8_0", force=True)
    assert _parse("--fix", "m.gguf") == ToGGUFOptions(fix="m.gguf")
    assert ToGGUFOptions().outtype == "f32" and "f32" in OUTTYPES


def test_every_field_is_an_option_with_its_help():
    text = " ".join(to_gguf.build_parser().format_help().split())
    assert {f.name for f, _ in option_fields(ToGGUFOptions)} == {f.name for f in dataclasses.fields(ToGGUFOptions)}
    for f, _ in option_fields(ToGGUFOptions):
        assert flags_of(f)[0] in text, f.name
    for part in ("positional arguments: folder a to_mla --format deepseek_v3 folder",
                 "weights' type in the GGUF (default f32)", "outputs: --out OUT the GGUF file to write --force "
                 "overwrite --out"):
        assert part in text, part


def test_a_bad_outtype_is_one_line_from_the_command_and_the_library():
    with pytest.raises(UsageError, match="argument --outtype: invalid choice"):
        _parse("ds", "--out", "m.gguf", "--outtype", "q4")
    with pytest.raises(ValueError, match="--outtype 'q4': one of f32, f16, bf16, q8_0"):
        ToGGUFOptions(folder="ds", out="m.gguf", outtype="q4")
