"""``verify-memory``'s and ``bench-decode``'s options declared once (:mod:`kvsplice.report.options`): each parser
is built from its dataclass, the shared report group (:class:`ReportOptions`) is one declaration, a parsed command
line is the dataclass with the library's defaults, and a bad value is one line naming the option."""

from __future__ import annotations

import pytest
from declared_options import check_declared

from kvsplice.cli import bench_decode, verify_memory
from kvsplice.io.options import from_args
from kvsplice.report.options import BenchDecodeOptions, ReportOptions, VerifyMemoryOptions


@pytest.mark.parametrize("cli, cls", [(verify_memory, VerifyMemoryOptions), (bench_decode, BenchDecodeOptions)])
def test_the_parser_is_the_dataclass_and_shares_the_report_group(cli, cls):
    opts = check_declared(cli.build_parser(), cls, [])
    assert issubclass(cls, ReportOptions) and (opts.device, opts.json, opts.seed, opts.progress) == (None, None, 0, True)
    help_text = " ".join(cli.build_parser().format_help().split())
    assert "--json FILE write " in help_text and "(and a plot FILE.png next to it)" in help_text


def test_verify_memory_parses_into_its_options_and_picks_its_decode_steps():
    o = from_args(VerifyMemoryOptions, verify_memory.build_parser().parse_args(
        ["--ckpt", "a.ckpt", "--seq-lens", "64", "16", "--dtype", "bf16", "--no-progress", "--json", "r.json"]))
    assert (o.ckpt, o.seq_lens, o.lengths, o.dtype, o.progress, o.json) == (("a.ckpt",), (64, 16), [16, 64], "bf16",
                                                                             False, "r.json")
    assert VerifyMemoryOptions().steps() == (8, None)
    steps, note = VerifyMemoryOptions(seq_lens=(4, 64)).steps()
    assert steps == 3 and "shortest --seq-lens 4" in note
    assert VerifyMemoryOptions(seq_lens=(4,), decode_steps=0).steps() == (0, None)


@pytest.mark.parametrize("cls, kw, needle", [
    (VerifyMemoryOptions, {"seq_lens": (0,)}, "--seq-lens must be >= 1"),
    (VerifyMemoryOptions, {"seq_lens": (8,), "decode_steps": 8}, "--decode-steps must be <= 7"),
    (VerifyMemoryOptions, {"budget_gb": 0.0}, "--budget-gb must be > 0"),
    (BenchDecodeOptions, {"ctx": (1, 0)}, "--ctx must be >= 1"),
    (BenchDecodeOptions, {"repeats": 0}, "--repeats must be >= 1"),
    (BenchDecodeOptions, {"max_seconds": -1.0}, "--max-seconds must be >= 0"),
    (VerifyMemoryOptions, {"budget_gb": 1e12}, "--budget-gb must be > 0 and <= 1e"),
    (BenchDecodeOptions, {"max_seconds": 1e12}, "--max-seconds must be >= 0 and <= 1e"),
])
def test_the_library_refuses_what_the_command_refuses(cls, kw, needle):
    with pytest.raises(ValueError, match=needle.replace("-", r"\-")):
        cls(**kw)


def test_a_bad_value_on_the_command_line_is_one_line(capsys):
    assert verify_memory.main(["--seq-lens", "8", "--decode-steps", "9"]) == 2
    assert bench_decode.main(["--warmup", "-1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["kvsplice verify-memory: error: --decode-steps must be <= 7 (the shortest --seq-lens 8 less the "
                   "one token the prefill needs), got 9", "kvsplice bench-decode: error: --warmup must be >= 0, got -1"]
