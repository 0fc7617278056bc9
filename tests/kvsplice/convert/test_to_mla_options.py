"""``to-mla``'s options declared once (:class:`kvsplice.convert.to_mla_options.ToMLAOptions`): the parser is built
from the dataclass's fields, a parsed command line is the dataclass, the library checks what the parsers check, and
a library call (:func:`kvsplice.convert.llama_run.run_llama`) converts as the command does."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
import torch

from kvsplice.cli import to_mla
from kvsplice.convert.llama_run import run_llama
from kvsplice.convert.to_mla_options import CALIB_TOKENS, REFINE_STEPS, ToMLAOptions
from kvsplice.io.options import flags_of, from_args, option_fields
from declared_options import check_one_line_refusal

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"
CALIB = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"


def _parse(*argv: str) -> ToMLAOptions:
    return from_args(ToMLAOptions, to_mla.build_parser().parse_args(list(argv)))


def test_the_command_line_is_the_dataclass_with_its_defaults():
    assert _parse("--model", "m", "--out", "o") == ToMLAOptions(model="m", out="o")
    o = _parse("--model", "m", "--out", "o", "--ratio", "4", "--refine-steps", "0", "--kvsplice-ratio", "0.5",
               "--rope-dims", "all", "--d-latent", "full", "--no-progress", "--force", "--threads", "1",
               "--format", "deepseek_v3", "--pad-latent", "512", "--latent-norm", "--calib-tokens", "64")
    assert (o.ratio, o.refine_steps, o.keep, o.keep_option, o.rope_dims, o.d_latent) == \
        (4.0, 0, 0.5, "--kvsplice-ratio", "all", "full")
    assert (o.progress, o.force, o.threads, o.format, o.pad_latent, o.latent_norm, o.calib_tokens) == \
        (False, True, 1, "deepseek_v3", 512, True, 64)
    d = ToMLAOptions(model="m", out="o")  # the defaults a library call and the command share
    assert (d.keep, d.keep_option, d.steps(), d.tokens(), d.layout(), d.batch_size) == \
        (None, "--kvsplice-keep", 0, CALIB_TOKENS, "per-head", 8)
    r = ToMLAOptions(model="m", out="o", ratio=2, kvsplice_keep=0.5)
    assert (r.steps(), r.layout(), r.keep, r.keep_option) == (REFINE_STEPS, "shared", 0.5, "--kvsplice-keep")


def test_every_field_is_an_option_with_its_help():
    text = " ".join(to_mla.build_parser().format_help().split())
    fields = option_fields(ToMLAOptions)
    assert {f.name for f, _ in fields} == {f.name for f in dataclasses.fields(ToMLAOptions)}
    for f, _ in fields:
        assert flags_of(f)[0] in text, f.name
    for part in ("--kvsplice-keep F | --kvsplice-ratio F", "keeps 50/30/10 %: KVSplice-50/70/90",
                 "(default 30 with --ratio, else 0", "--no-progress no progress bars", "outputs: --out OUT output "
                 "checkpoint (.ckpt)", "--force overwrite --out / --json (a folder: only one to_mla wrote"):
        assert part in text, part
    assert "--dtype" not in text  # the converted model keeps the source's dtype


@pytest.mark.parametrize("argv, needle", [
    (["--out", "o"], "--model"), (["--model", "m"], "--out"),
    (["--model", "m", "--out", "o", "--ratio", "0.5"], "argument --ratio: must be > 1"),
    (["--model", "m", "--out", "o", "--kvsplice-keep", "1.5"], "argument --kvsplice-keep: must be in (0, 1)"),
    (["--model", "m", "--out", "o", "--kvsplice-keep", "0.5", "--kvsplice-ratio", "0.5"], "not allowed with"),
    (["--model", "m", "--out", "o", "--refine-steps", "-1"], "must be a whole number of steps in [0, 100000]"),
    (["--model", "m", "--out", "o", "--rope-layout", "x"], "argument --rope-layout: invalid choice"),
])
def test_a_bad_command_line_is_one_line_naming_the_option(argv, needle):
    check_one_line_refusal(_parse, argv, needle)


@pytest.mark.parametrize("kw, needle", [
    ({"ratio": 0.25}, "--ratio must be > 1"), ({"kvsplice_keep": 2}, "--kvsplice-keep must be in (0, 1)"),
    ({"kvsplice_keep": 0.5, "kvsplice_ratio": 0.5}, "not allowed with"),
    ({"refine_steps": -3}, "--refine-steps must be a whole number"), ({"batch_size": 0}, "--batch-size must be >= 1"),
    ({"format": "gguf"}, "--format 'gguf': one of native, deepseek_v3"),
])
def test_a_library_call_is_checked_as_the_command_line_is(kw, needle):
    with pytest.raises(ValueError) as e:
        ToMLAOptions(model="m", out="o", **kw)
    assert needle in str(e.value), str(e.value)


def test_the_library_takes_the_options_object_not_a_namespace():
    hints = typing.get_type_hints(run_llama)
    assert hints["opts"] is ToMLAOptions and list(inspect.signature(run_llama).parameters) == ["opts"]


@pytest.fixture(scope="module")
def s260k(tmp_path_factory):
    if not ((STORIES / "stories260K.bin").is_file() and CALIB.is_file()):
        pytest.skip(f"stories260K / TinyStories not found under {DATA}")
    from kvsplice.convert.llama2c import convert_llama2c

    return convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("s260k"))


def test_a_library_call_converts_as_the_command_does(s260k, tmp_path, capsys):
    """``run_llama(ToMLAOptions(...))`` and ``kvsplice to-mla`` with the same few options: the same folder."""
    from safetensors.torch import load_file

    lib, cli = tmp_path / "lib", tmp_path / "cli"
    assert run_llama(ToMLAOptions(model=str(s260k), calib=str(CALIB), calib_tokens=1024, seq_len=128, d_latent=12,
                                  kvsplice_keep=0.5, out=str(lib), progress=False)) == 0
    assert to_mla.main(["--model", str(s260k), "--calib", str(CALIB), "--calib-tokens", "1024", "--seq-len", "128",
                        "--d-latent", "12", "--kvsplice-keep", "0.5", "--out", str(cli), "--no-progress"]) == 0
    files = sorted(p.name for p in lib.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in cli.glob("*.safetensors"))
    for name in files:
        a, b = load_file(lib / name), load_file(cli / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
