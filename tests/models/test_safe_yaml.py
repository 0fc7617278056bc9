"""The one reader of user YAML (:mod:`models.safe_yaml`) and every door to it: ``kvsplice train --config``,
jsonargparse's own parsing of config files and values, and model configs (:meth:`GPTConfig.from_file`). A "billion
laughs" document fails fast in one line; a key given twice is named; a FIFO or ``/dev/zero`` is never read."""

from __future__ import annotations

import os
import time

import pytest

from models.config import GPTConfig
from models.safe_yaml import MAX_ALIASES, YamlRefused, load_yaml, load_yaml_file

pytestmark = pytest.mark.timeout(60)

LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
"""Nine levels of nine aliases: 9**9 (387 million) strings once expanded."""
DUPLICATE = "model:\n  n_layer: 2\n  d_model: 64\n  n_layer: 12\n"


def test_a_billion_laughs_is_refused_before_it_is_built():
    t0 = time.perf_counter()
    with pytest.raises(YamlRefused, match=f"more than {MAX_ALIASES} YAML aliases"):
        load_yaml(LAUGHS, "laughs.yaml")
    assert time.perf_counter() - t0 < 2


def test_a_duplicate_key_is_named_with_its_line():
    with pytest.raises(YamlRefused, match=r"the key 'n_layer' is given twice in one mapping \(line 4\)"):
        load_yaml(DUPLICATE, "c.yaml")


def test_what_configs_use_still_loads():
    text = "base: &b {lr: 0.1, steps: 3}\nrun:\n  <<: *b\n  steps: 5\nlist: [*b, *b]\n'1': x\n1: y\n"
    doc = load_yaml(text)
    assert doc["run"] == {"lr": 0.1, "steps": 5} and doc["list"] == [{"lr": 0.1, "steps": 3}] * 2


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_file_that_is_no_regular_file_is_never_read(tmp_path, kind):
    p = tmp_path / "c.yaml"
    if kind == "fifo":
        os.mkfifo(p)
    else:
        p.symlink_to("/dev/zero")
    with pytest.raises(YamlRefused, match="not a regular file"):
        load_yaml_file(p)


@pytest.mark.parametrize("text,expect", [(LAUGHS, "YAML aliases"), (DUPLICATE, "'n_layer' is given twice")])
def test_model_configs_read_through_it(tmp_path, text, expect):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=expect):
        GPTConfig.from_file(p)


@pytest.mark.parametrize("text,expect", [(LAUGHS, "YAML aliases"), (DUPLICATE, "'n_layer' is given twice")])
def test_train_config_is_one_line(tmp_path, capsys, text, expect):
    from hostile import one_error
    from training import fit

    p = tmp_path / "c.yaml"
    p.write_text(text)
    assert fit.main(["--config", str(p)]) == 2
    one_error(2, capsys.readouterr().err, fit.PROG, expect)


def test_jsonargparse_parses_through_it(tmp_path):
    """Config files jsonargparse reads itself (a nested ``--model cfg.yaml``) and option values."""
    from jsonargparse import ArgumentParser, get_loader

    from training.fit import safe_jsonargparse_yaml

    safe_jsonargparse_yaml()
    assert getattr(get_loader("yaml"), "checked_by_safe_yaml", False)
    p = ArgumentParser(exit_on_error=False)
    p.add_argument("--cfg", action="config")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--s", type=str, default="")
    ok = tmp_path / "ok.yaml"
    ok.write_text("n: 3\n")
    assert p.parse_args(["--cfg", str(ok)]).n == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("n: 3\nn: 4\n")
    with pytest.raises(Exception, match="given twice|n"):
        p.parse_args(["--cfg", str(bad)])
    t0 = time.perf_counter()
    inline = "{" + LAUGHS.replace("\n", ", ").rstrip(", ") + "}"
    assert p.parse_args(["--s", inline]).s == inline  # refused as YAML: the value stays the string given
    assert time.perf_counter() - t0 < 5
