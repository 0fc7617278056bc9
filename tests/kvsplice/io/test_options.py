"""The options builder (:mod:`kvsplice.io.options`): a dataclass's fields are the command line — flags, types from
the annotations, required options, defaults, exclusive groups, help — and a parsed command line is the dataclass;
the shared amounts (:mod:`kvsplice.core.amounts`) refuse a bad value in one line naming the option."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import pytest

from kvsplice.core.amounts import (MAX_TIMES_SMALLER, check_kept_fraction, check_times_smaller, kept_fraction,
                                   times_smaller)
from kvsplice.io.cli import Parser, UsageError, pos_int
from kvsplice.io.options import Exclusive, add_options, check_counts, count, defaults, from_args, opt
from kvsplice.io.run_options import RunOptions, run_parser
from declared_options import check_one_line_refusal


@dataclass(frozen=True)
class _Opts(RunOptions):
    OPTION_GROUPS: ClassVar = (Exclusive(("budget", "ratio"), required=True),)

    model: str = opt(help="the model")
    budget: Optional[float] = opt(None, help="bytes per token")
    ratio: Optional[float] = opt(None, parse=times_smaller, help="times smaller")
    keep: Optional[float] = opt(None, flags=("--keep", "--old-keep"), parse=kept_fraction, help="kept fraction")
    count: int = opt(3, parse=pos_int, help="a count (default 3)")
    tasks: tuple[str, ...] = opt(("a", "b"), metavar="TASK", help="tasks, 100% of them")
    mode: str = opt("x", choices=("x", "y"), help="a mode")
    library_only: int = opt(7, cli=False, help="not on the command line")


def _parser() -> Parser:
    return run_parser("t", _Opts, force_help="overwrite it")


def _parse(*argv: str) -> _Opts:
    return from_args(_Opts, _parser().parse_args(list(argv)))


def test_flags_types_defaults_and_the_dataclass():
    o = _parse("--model", "m", "--ratio", "4", "--old-keep", "0.5", "--count", "5", "--tasks", "c", "--no-progress",
               "--threads", "2")
    assert o == _Opts(model="m", ratio=4.0, keep=0.5, count=5, tasks=("c",), progress=False, threads=2)
    assert isinstance(o.tasks, tuple) and isinstance(o.ratio, float)
    d = _parse("--model", "m", "--budget", "10")
    assert (d.budget, d.count, d.tasks, d.mode, d.progress, d.force, d.dtype, d.library_only) == \
        (10.0, 3, ("a", "b"), "x", True, False, "fp32", 7)
    assert defaults(_Opts)["count"] == 3 and "model" not in defaults(_Opts)


@pytest.mark.parametrize("argv, needle", [
    (["--budget", "1"], "--model"),                                     # required: no default
    (["--model", "m"], "--budget"),                                     # one of the exclusive group is required
    (["--model", "m", "--budget", "1", "--ratio", "2"], "not allowed with"),
    (["--model", "m", "--ratio", "0.25"], "argument --ratio: must be > 1"),
    (["--model", "m", "--ratio", "nan"], "argument --ratio: must be > 1"),
    (["--model", "m", "--ratio", "1e9"], "at most 1e+06"),
    (["--model", "m", "--budget", "1", "--keep", "1"], "argument --keep/--old-keep: must be in (0, 1)"),
    (["--model", "m", "--budget", "1", "--count", "0"], "argument --count: must be >= 1"),
    (["--model", "m", "--budget", "x"], "argument --budget: invalid float value"),
    (["--model", "m", "--budget", "1", "--mode", "z"], "argument --mode: invalid choice"),
    (["--model", "m", "--budget", "1", "--dtype", "fp8"], "argument --dtype: invalid choice"),
])
def test_a_bad_command_line_is_one_line_naming_the_option(argv, needle):
    check_one_line_refusal(_parse, argv, needle)


def test_every_option_has_its_help_and_the_library_only_field_none():
    p = _parser()
    text = " ".join(p.format_help().split())
    for flag, help in (("--model", "the model"), ("--tasks", "tasks, 100% of them"), ("--force", "overwrite it"),
                       ("--no-progress", "no progress bar"), ("--count", "a count (default 3)")):
        assert flag in text and help in text, flag
    assert "--library-only" not in text
    for action in p._actions:
        assert action.help, action.option_strings
    whole = Parser(prog="t")
    add_options(whole, _Opts)  # the class's own fields in their order, then its base's
    assert [a.dest for a in whole._actions[1:]] == ["model", "budget", "ratio", "keep", "count", "tasks", "mode",
                                                    "force", "threads", "progress", "device", "dtype"]


def test_the_declaration_refuses_a_mutable_default():
    with pytest.raises(TypeError, match="immutable"):
        opt([1, 2], help="x")


@pytest.mark.parametrize("value", [1, 0.5, 0, -3, float("inf"), float("nan"), MAX_TIMES_SMALLER * 2, "x", True])
def test_times_smaller_refuses_what_is_not_a_compression(value):
    with pytest.raises(ValueError, match=r"^--ratio must be > 1"):
        check_times_smaller("--ratio", value)


def test_times_smaller_and_kept_fraction_take_what_they_name():
    assert check_times_smaller("--ratio", 4) == 4.0 and check_times_smaller("--r", "1.5") == 1.5
    assert check_times_smaller("--alloc-ratio", 1, allow_one=True) == 1.0
    assert check_kept_fraction("--keep", 0.25) == 0.25
    for bad in (0, 1, 1.5, float("nan"), "x"):
        with pytest.raises(ValueError, match=r"^--keep must be in \(0, 1\)"):
            check_kept_fraction("--keep", bad)


@dataclass(frozen=True)
class _Positional:
    model: str = opt(flags=("model",), help="the model file")
    folder: Optional[str] = opt(None, flags=("folder",), nargs="?", help="an optional folder")
    out: str = opt(help="the output")


def test_a_flag_without_a_dash_is_a_positional_argument():
    p = Parser(prog="t")
    add_options(p, _Positional)
    assert from_args(_Positional, p.parse_args(["m.bin", "--out", "o"])) == _Positional(model="m.bin", out="o")
    assert from_args(_Positional, p.parse_args(["m.bin", "dir", "--out", "o"])).folder == "dir"
    assert "--out OUT model [folder]" in " ".join(p.format_usage().split())
    with pytest.raises(UsageError, match="the following arguments are required: model"):
        p.parse_args(["--out", "o"])


@dataclass(frozen=True)
class _Counted:
    seeds: int = count(3, hi=10, why="time", help="seeds")
    sinks: int = count(0, lo=0, help="sinks")
    layers: Optional[tuple[int, ...]] = count(None, lo=0, help="layers")
    window: Optional[int] = count(None, lo=2, flags=("--win",), help="a window")

    def __post_init__(self) -> None:
        check_counts(self)


@pytest.mark.parametrize("kw, message", [({"seeds": 0}, "--seeds must be >= 1, got 0"),
                                         ({"seeds": 11}, "--seeds must be <= 10 (time), got 11"),
                                         ({"sinks": -1}, "--sinks must be >= 0, got -1"),
                                         ({"layers": (2, -1)}, "--layers must be >= 0, got -1"),
                                         ({"window": 1}, "--win must be >= 2, got 1"),
                                         ({"seeds": True}, "--seeds must be an integer")])
def test_a_count_is_checked_by_the_bounds_it_declares(kw, message):
    assert _Counted(layers=(0, 5), window=2) == _Counted(seeds=3, layers=(0, 5), window=2)  # in bounds; None passes
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        _Counted(**kw)
    p = Parser(prog="t")
    add_options(p, _Counted)
    assert from_args(_Counted, p.parse_args(["--layers", "1", "2", "--win", "4"])) == _Counted(layers=(1, 2), window=4)
