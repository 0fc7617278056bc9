"""``bench-balance``'s options declared once (:class:`kvsplice.select.experiment_options.BenchBalanceOptions`): the
parser is built from the dataclass, a parsed command line is the dataclass with the library's defaults (what
:func:`kvsplice.select.experiment.run_bench` takes), and a bad value is refused by the library as by the command."""

from __future__ import annotations

import pytest
from declared_options import check_declared

from kvsplice.cli import bench_balance
from kvsplice.io.options import from_args
from kvsplice.select.experiment_options import ARMS, BenchBalanceOptions


def test_the_parser_is_the_dataclass():
    o = check_declared(bench_balance.build_parser(), BenchBalanceOptions, ["--model", "m", "--data", "d.txt"],
                       model="m", data="d.txt")
    assert (o.T, o.seeds, o.methods, o.threads) == ((1, 2, 3, 4), 10, ARMS, 1)


def test_the_old_name_of_arms_and_the_tuples():
    o = from_args(BenchBalanceOptions, bench_balance.build_parser().parse_args(
        ["--model", "m", "--data", "d", "--methods", "uniform", "--T", "0", "2", "--layers", "1"]))
    assert (o.methods, o.T, o.layers) == (("uniform",), (0, 2), (1,))


@pytest.mark.parametrize("kw, needle", [({"block_size": 3}, "--block-size must be an even number"),
                                        ({"seeds": 0}, "--seeds must be >= 1"), ({"T": (31,)}, "--T must be <= 30"),
                                        ({"methods": ("nope",)}, "unknown selector 'nope'"),
                                        ({"kernel_temp": -1.0}, "--kernel-temp must be >= 0"),
                                        ({"kernel_temp": 1e12}, "--kernel-temp must be >= 0 and <= 1000"),
                                        ({"c_scale": 1e12}, "--c-scale must be > 0 and <= 1e")])
def test_the_library_refuses_what_the_command_refuses(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("-", r"\-")):
        BenchBalanceOptions(model="m", data="d", **kw)
