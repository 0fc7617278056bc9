"""Every command-line tool (issue 22): one argument parser whose errors are one ``PROG: error: ...`` line with exit
status 2 (it was defined five times, and ``to_mla``/``fit_bases``/``eval_bases``/``convert_llama2c`` exited 1 or
printed argparse's usage block), and the same output rules for the tools not covered by the other hostile-input
files: ``convert_llama2c`` never writes into a folder holding its input, ``verify_memory``'s plot beside ``--json``
is never replaced without ``--force``, and ``--json`` temporaries of killed runs are removed."""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest

import torch

from hostile import REPO, dead_pid, edit_ckpt, one_error, snapshot, tiny_ckpt

CLIS = {  # module: prefix of its error line
    "kvsplice.generate": "generate", "kvsplice.to_mla": "to_mla", "kvsplice.fit_bases": "fit_bases",
    "kvsplice.eval_bases": "eval_bases", "kvsplice.verify_memory": "verify_memory",
    "kvsplice.bench_decode": "bench_decode", "kvsplice.bench_balance": "bench_balance",
    "kvsplice.convert_llama2c": "convert_llama2c", "training.export": "python -m training.export",
    "training.evaluate": "python -m training.evaluate",
}


def test_one_argument_parser_for_every_tool():
    defined = [str(f.relative_to(REPO)) for pkg in ("kvsplice", "training", "models", "data")
               for f in sorted((REPO / pkg).rglob("*.py"))
               if re.search(r"^class \w+\(argparse\.ArgumentParser\)", f.read_text(), re.M)]
    assert defined == ["kvsplice/io/cli.py"]
    plain = [str(f.relative_to(REPO)) for pkg in ("kvsplice", "training") for f in sorted((REPO / pkg).rglob("*.py"))
             if "argparse.ArgumentParser(" in f.read_text()]
    assert plain == [], "tools build their parser with kvsplice.io.cli.Parser"


@pytest.mark.parametrize("module", CLIS)
def test_a_bad_option_is_one_line_and_exit_2(module, capsys):
    rc = importlib.import_module(module).main(["--no-such-option", "1"])
    one_error(rc, capsys.readouterr().err, CLIS[module])


def test_convert_llama2c_never_writes_into_the_folder_of_its_input(tmp_path, capsys):
    from kvsplice.convert_llama2c import main

    model = tmp_path / "model.bin"
    model.write_bytes(os.urandom(64))
    before = snapshot(tmp_path)
    for out in (tmp_path, tmp_path / "sub" / ".."):
        rc = main([str(model), "--out", str(out), "--force"])
        one_error(rc, capsys.readouterr().err, "convert_llama2c", "contains the input model")
        assert snapshot(tmp_path) == before


def test_verify_memory_never_replaces_a_plot_without_force(tmp_path, capsys):
    from kvsplice.verify_memory import main

    (tmp_path / "m.png").write_bytes(b"an earlier plot")
    rc = main(["--config", "gpt2", "--seq-lens", "8", "--json", str(tmp_path / "m.json"), "--no-progress"])
    one_error(rc, capsys.readouterr().err, "verify_memory", "m.png already exists (use --force")
    assert sorted(os.listdir(tmp_path)) == ["m.png"]


def test_evaluate_and_verify_memory_never_touch_a_checkpoint(tmp_path, data_cache, capsys):
    from kvsplice.verify_memory import main as verify_memory
    from training.evaluate import main as evaluate

    ckpt = tiny_ckpt(tmp_path / "ok.ckpt", data_cache)
    before = snapshot(tmp_path)
    rc = evaluate(["--ckpt", str(ckpt), "--json", str(ckpt), "--force"])  # was: replaced by the JSON report
    one_error(rc, capsys.readouterr().err, "python -m training.evaluate", "is the input --ckpt")
    assert snapshot(tmp_path) == before
    bad = edit_ckpt(ckpt, tmp_path / "nan.ckpt", "model.transformer.wte.weight", torch.full((300, 32), float("nan")))
    rc = verify_memory(["--ckpt", str(bad), "--seq-lens", "8", "--no-progress"])
    one_error(rc, capsys.readouterr().err, "verify_memory", "tensor model.transformer.wte.weight holds 9600 NaN/inf")


def test_json_outputs_are_atomic_and_clean_up_after_killed_runs(tmp_path):
    from kvsplice.io.cli import UsageError
    from kvsplice.io.outputs import output_file, write_json

    out = tmp_path / "r.json"
    stale, other = tmp_path / f".r.json.{dead_pid()}.tmp", tmp_path / f".x.json.{dead_pid()}.tmp"
    stale.write_text("{")
    other.write_text("{")
    assert output_file(out, force=False, option="--json") == out.resolve()
    assert not stale.exists() and other.exists()  # only this output's temporaries
    write_json({"a": 1}, out)
    assert out.read_text() == '{\n  "a": 1\n}\n' and sorted(os.listdir(tmp_path)) == [other.name, "r.json"]
    with pytest.raises(UsageError, match="already exists"):
        output_file(Path(os.path.relpath(out)), force=False, option="--json")
