"""``convert-llama2c``'s options declared once (:class:`kvsplice.convert.llama2c.Llama2cOptions`): the parser is
built from the dataclass's fields (the model a positional argument), and a library call converts as the command."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvsplice.cli import convert_llama2c
from kvsplice.convert.llama2c import Llama2cOptions, convert_options
from kvsplice.io.cli import UsageError
from kvsplice.io.options import flags_of, from_args, option_fields

STORIES = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "stories260K"


def _parse(*argv: str) -> Llama2cOptions:
    return from_args(Llama2cOptions, convert_llama2c.build_parser().parse_args(list(argv)))


def test_the_command_line_is_the_dataclass_with_its_defaults():
    assert _parse("m.bin", "--out", "d") == Llama2cOptions(model="m.bin", out="d")
    assert _parse("m.bin", "--tokenizer", "t.bin", "--out", "d", "--force") == \
        Llama2cOptions(model="m.bin", tokenizer="t.bin", out="d", force=True)
    for argv, needle in ((["--out", "d"], "required: model"), (["m.bin"], "required: --out")):
        with pytest.raises(UsageError, match=needle):
            _parse(*argv)


def test_every_field_is_an_option_with_its_help():
    text = " ".join(convert_llama2c.build_parser().format_help().split())
    assert {f.name for f, _ in option_fields(Llama2cOptions)} == {f.name for f in dataclasses.fields(Llama2cOptions)}
    for f, _ in option_fields(Llama2cOptions):
        assert flags_of(f)[0] in text, f.name
    for part in ("positional arguments: model llama2.c model .bin (e.g. stories260K.bin)",
                 "omit to convert weights only", "outputs: --out OUT output directory --force write into an existing"):
        assert part in text, part


@pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(), reason="stories260K not found")
def test_a_library_call_converts_as_the_command_does(tmp_path, capsys):
    out, cfg, n = convert_options(Llama2cOptions(model=str(STORIES / "stories260K.bin"), out=str(tmp_path / "a")))
    assert convert_llama2c.main([str(STORIES / "stories260K.bin"), "--out", str(tmp_path / "b")]) == 0
    assert f"{n:,} params" in capsys.readouterr().out and cfg["dim"] > 0
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
