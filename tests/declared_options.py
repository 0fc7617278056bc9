"""The check every command whose options are a dataclass (:mod:`kvsplice.io.options`) passes: its parser is built
from the dataclass alone — every argument is a field and every field an argument, shown in ``--help`` with its
help — and the command line of the required options alone is the dataclass with its defaults (one set of defaults
for the command and the library)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

from kvsplice.io.options import OPTION, flags_of, from_args, option_fields


def check_declared(parser: argparse.ArgumentParser, cls: type, required: Sequence[str], **values: Any) -> Any:
    """Assert that ``parser`` is ``cls``'s declaration and that parsing ``required`` (the required options only)
    gives ``cls(**values)`` — the dataclass's own defaults; returns that object."""
    fields = {f.name: f for f, _ in option_fields(cls)}
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert sorted(a.dest for a in actions) == sorted(fields), "arguments that are not fields, or fields that are not " \
        "arguments: " + str(sorted(set(a.dest for a in actions) ^ set(fields)))
    text = "".join(parser.format_help().split())  # without whitespace: help lines wrap (also at hyphens)
    for a in actions:
        f = fields[a.dest]
        assert tuple(a.option_strings) == flags_of(f), (a.dest, a.option_strings)
        assert a.help and f.metadata[OPTION]["help"], f"{a.dest} has no help"
        for flag in a.option_strings:
            assert flag in text, flag
        assert "".join(a.help.replace("%%", "%").split()) in text, a.dest
    parsed = from_args(cls, parser.parse_args(list(required)))
    assert parsed == cls(**values), (parsed, values)
    for name, f in fields.items():  # a parsed default is the field's default, of the field's type
        if f.default is not dataclasses.MISSING and name not in values:
            assert getattr(parsed, name) == f.default and type(getattr(parsed, name)) is type(f.default), name
    return parsed


def check_one_line_refusal(parse, argv: Sequence[str], needle: str) -> None:
    """``parse(*argv)`` (a command's parser) refuses with one line that holds ``needle`` (the option's name)."""
    import pytest

    from kvsplice.io.cli import UsageError

    with pytest.raises(UsageError) as e:
        parse(*argv)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
