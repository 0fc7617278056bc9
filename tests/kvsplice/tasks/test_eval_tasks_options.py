"""``eval-tasks``' options declared once (:class:`kvsplice.tasks.options.EvalTasksOptions`): the parser is built
from the dataclass's fields, a parsed command line is the dataclass, and the library's defaults are the command's."""

from __future__ import annotations

import pytest

from kvsplice.cli import eval_tasks
from kvsplice.io.options import from_args
from kvsplice.tasks.options import EvalTasksOptions
from declared_options import check_one_line_refusal


def _parse(*argv: str) -> EvalTasksOptions:
    return from_args(EvalTasksOptions, eval_tasks.build_parser().parse_args(list(argv)))


def test_the_command_line_is_the_dataclass_with_its_defaults():
    assert _parse("--model", "m", "--out", "o.json") == EvalTasksOptions(model="m", out="o.json")
    o = _parse("--model", "m", "--out", "o", "--plan", "a.json", "b.json", "--method", "int8", "--lengths", "256",
               "512", "--tasks", "passkey", "--setting", "aware", "--no-progress", "--force", "--dtype", "bf16")
    assert (o.plans, o.methods, o.lengths, o.tasks, o.settings) == (("a.json", "b.json"), ("int8",), (256, 512),
                                                                    ("passkey",), ("aware",))
    assert (o.progress, o.force, o.dtype, o.n, o.door) == (False, True, "bf16", 8, "decoder")


@pytest.mark.parametrize("argv, needle", [
    (["--out", "o"], "--model"), (["--model", "m"], "--out"),
    (["--model", "m", "--out", "o", "--tasks", "nosuch"], "argument --tasks: invalid choice"),
    (["--model", "m", "--out", "o", "--lengths", "0"], "argument --lengths: must be >= 1"),
    (["--model", "m", "--out", "o", "--n", "x"], "argument --n: invalid pos_int value"),
])
def test_a_bad_command_line_is_one_line_naming_the_option(argv, needle):
    check_one_line_refusal(_parse, argv, needle)


def test_the_help_keeps_its_options():
    text = " ".join(eval_tasks.build_parser().format_help().split())
    for part in ("--plan PLAN [PLAN ...]", "--method METHOD [METHOD ...]", "--tasks TASK [TASK ...]",
                 "prompt lengths in tokens (default 1024)", "--force start --out over", "--no-progress"):
        assert part in text, part
