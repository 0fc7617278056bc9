"""``evaluate``'s options declared once (:class:`training.evaluate_options.EvaluateOptions`): the parser is built
from the dataclass — ``--ckpt`` repeated, ``--data.synthetic true`` a value, not a switch — a parsed command line is
the dataclass with the library's defaults, and the library refuses a bad count as the command does."""

from __future__ import annotations

import pytest
from declared_options import check_declared

from kvsplice.io.cli import UsageError
from kvsplice.io.options import from_args
from training import evaluate
from training.evaluate_options import EvaluateOptions


def _parse(*argv: str) -> EvaluateOptions:
    return from_args(EvaluateOptions, evaluate.build_parser().parse_args(list(argv)))


def test_the_parser_is_the_dataclass():
    o = check_declared(evaluate.build_parser(), EvaluateOptions, ["--ckpt", "a.ckpt"], ckpt=("a.ckpt",))
    assert (o.tokens, o.dtype, o.device, o.data_synthetic, o.cache_quant) == (16384, "fp32", None, None, None)


def test_repeated_checkpoints_and_the_data_overrides():
    o = _parse("--ckpt", "a", "--ckpt", "b", "--data.synthetic", "false", "--data.path", "v.txt", "--device", "cpu")
    assert (o.ckpt, o.data_synthetic, o.data_path, o.torch_device()) == (("a", "b"), False, "v.txt", "cpu")
    with pytest.raises(UsageError, match="argument --data.synthetic: expected true or false"):
        _parse("--ckpt", "a", "--data.synthetic", "maybe")
    with pytest.raises(UsageError, match="unrecognized arguments: b"):
        _parse("--ckpt", "a", "b")  # one checkpoint per --ckpt


@pytest.mark.parametrize("kw, needle", [({"tokens": 0}, "--tokens must be >= 1"),
                                        ({"cache_chunk": 0}, "--cache-chunk must be >= 1"),
                                        ({"sample_tokens": -1}, "--sample-tokens must be >= 0")])
def test_the_library_refuses_what_the_command_refuses(kw, needle, capsys):
    with pytest.raises(ValueError, match=needle.replace("-", r"\-")):
        EvaluateOptions(ckpt=("a",), **kw)
    flag, value = next(iter(kw.items()))
    assert evaluate.main(["--ckpt", "a", f"--{flag.replace('_', '-')}", str(value)]) == 2
    assert capsys.readouterr().err == f"kvsplice evaluate: error: {needle}, got {value}\n"
