"""``fit-bases``' options declared once (:class:`kvsplice.lowrank.options.FitBasesOptions`, over the group it shares
with ``eval-bases``): the parser is built from the dataclass, a parsed command line is the dataclass with the
library's defaults, its jobs are every (method, RoPE mode, spec), and the library refuses what the command refuses."""

from __future__ import annotations

import pytest
from declared_options import check_declared

from kvsplice.cli import fit_bases
from kvsplice.io.options import from_args
from kvsplice.lowrank.options import BasesTextOptions, FitBasesOptions

REQUIRED = dict(model="m", fit=("kq",), rank=(2,), calib="c.txt", out="b.safetensors")


def _parse(*argv: str) -> FitBasesOptions:
    return from_args(FitBasesOptions, fit_bases.build_parser().parse_args(list(argv)))


def test_the_parser_is_the_dataclass():
    o = check_declared(fit_bases.build_parser(), FitBasesOptions, ["--model", "m", "--fit", "kq", "--rank", "2",
                                                                   "--calib", "c.txt", "--out", "b.safetensors"],
                       **REQUIRED)
    assert isinstance(o, BasesTextOptions) and (o.batch_size, o.rope, o.bases_dtype, o.forward_timing) == \
        (8, ("post",), "fp32", True)


def test_the_command_line_and_its_jobs():
    o = _parse("--model", "m", "--method", "kq", "fisher", "--alloc-ratio", "2", "4", "--rope", "post", "pre",
               "--calib", "c", "--out", "{method}_{rope}_{rank}", "--no-forward-timing", "--no-progress")
    assert (o.fit, o.alloc_ratio, o.forward_timing, o.progress) == (("kq", "fisher"), (2.0, 4.0), False, False)
    assert len(o.jobs()) == 8 and o.jobs()[0] == ("kq", "post", {"alloc_ratio": 2.0})
    e = FitBasesOptions(**{**REQUIRED, "rank": None, "energy": 0.9, "rank_v": 3})
    assert e.jobs() == [("kq", "post", {"rank": None, "energy": 0.9, "rank_v": 3, "energy_v": None})]


@pytest.mark.parametrize("kw, needle", [
    ({"rank": None}, "give one of --rank, --energy and --alloc-ratio"),
    ({"energy": 0.5}, "not --rank and --energy"),
    ({"rank_v": 2, "energy_v": 0.5}, "--rank-v or --energy-v, not both"),
    ({"uniform_ranks": True}, "--uniform-ranks raises the ranks --energy chooses"),
    ({"rank": None, "alloc_ratio": (0.5,)}, "--alloc-ratio must be >= 1"),
    ({"fit": ("nope",)}, "--fit: choose from"),
    ({"batch_size": 0}, "--batch-size must be >= 1"),
])
def test_the_library_refuses_what_the_command_refuses(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("-", r"\-").replace("(", r"\(")):
        FitBasesOptions(**{**REQUIRED, **kw})


def test_the_exclusive_key_specs_on_the_command_line(capsys):
    args = ["--model", "m", "--fit", "kq", "--calib", "c", "--out", "o"]
    assert fit_bases.main(args) == 2
    assert fit_bases.main([*args, "--rank", "2", "--energy", "0.9"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "one of the arguments --rank --energy --alloc-ratio is required" in err[0]
    assert "argument --energy: not allowed with argument --rank" in err[1]
