"""``eval-bases``' options declared once (:class:`kvsplice.evaluation.options.EvalBasesOptions`): the parser is
built from the dataclass — the options shared with ``fit-bases`` declared once
(:class:`~kvsplice.lowrank.options.BasesTextOptions`), ``--method fd-online``'s in their own group — a parsed
command line is the dataclass with the library's defaults (what the evaluators take)."""

from __future__ import annotations

import dataclasses

import pytest
from declared_options import check_declared

from kvsplice.cli import eval_bases, fit_bases
from kvsplice.evaluation.options import EVAL_TOKENS, EvalBasesOptions, FdOnlineOptions
from kvsplice.io.options import from_args
from kvsplice.lowrank.options import BasesTextOptions


def test_the_parser_is_the_dataclass():
    o = check_declared(eval_bases.build_parser(), EvalBasesOptions, ["--model", "m", "--data", "d.txt"], model="m",
                       data="d.txt")
    assert (o.method, o.batch_size, o.chunk_size, o.diagnostics, o.rank, o.eval_tokens) == \
        ("static", 8, 64, False, 4, EVAL_TOKENS)


def test_the_shared_options_are_one_declaration():
    shared = {f.name for f in dataclasses.fields(BasesTextOptions)}
    flags = {}
    for cli in (eval_bases, fit_bases):
        flags[cli] = {a.dest: a.option_strings for a in cli.build_parser()._actions if a.dest in shared}
    assert set(flags[eval_bases]) == shared == set(flags[fit_bases]) and flags[eval_bases] == flags[fit_bases]


def test_fd_online_options_are_their_group_and_the_decoders_arguments():
    p = eval_bases.build_parser()
    group = next(g for g in p._action_groups if g.title == FdOnlineOptions.GROUP)
    assert {a.dest for a in group._group_actions} == {f.name for f in dataclasses.fields(FdOnlineOptions)}
    o = from_args(EvalBasesOptions, p.parse_args(["--model", "m", "--data", "d", "--method", "fd-online", "--rank",
                                                  "3", "--fd-decay", "0.9", "--bases", "a", "b"]))
    assert o.bases == ("a", "b") and o.online_kw() == dict(
        rank_k=3, rank_v=3, ell=None, tau_k=None, tau_v=None, relative=False, max_chunk_len=256, max_chunks=None,
        min_chunk_len=1, warmup=16, fd_decay=0.9)


@pytest.mark.parametrize("kw, needle", [({"prompt_len": -1}, "--prompt-len must be >= 0"),
                                        ({"chunk_size": 0}, "--chunk-size must be >= 1"),
                                        ({"seq_len": 0}, "--seq-len must be >= 1")])
def test_the_library_refuses_what_the_command_refuses(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("-", r"\-")):
        EvalBasesOptions(model="m", data="d", **kw)
