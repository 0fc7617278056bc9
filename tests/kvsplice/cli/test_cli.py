"""Every command-line tool (:mod:`kvsplice.io.cli`, :mod:`kvsplice.io.files`; issues 22 and 31): one argument
parser whose errors are one ``PROG: error: ...`` line with exit status 2 (it was defined five times, and
``to_mla``/``fit_bases``/``eval_bases``/``convert_llama2c`` exited 1 or printed argparse's usage block); Ctrl-C is one
``PROG: interrupted`` line with exit status 130 (it was 46-91 lines of traceback); an output is claimed for the run
(two runs to one new ``--out`` both exited 0, the last write winning); and the same output rules for the tools not
covered by their own test files: ``convert_llama2c`` never writes into a folder holding its input and writes its files
with the umask's modes, ``verify_memory``'s plot beside ``--json`` is never replaced without ``--force``, and
``--json`` temporaries of killed runs are removed."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

import torch

from hostile import REPO, dead_pid, edit_ckpt, one_error, prog_of, snapshot, tiny_ckpt

CLIS = {  # module: prefix of its error line
    "kvsplice.cli.generate": "kvsplice generate", "kvsplice.cli.to_mla": "kvsplice to-mla", "kvsplice.cli.fit_bases": "kvsplice fit-bases",
    "kvsplice.cli.eval_bases": "kvsplice eval-bases", "kvsplice.cli.verify_memory": "kvsplice verify-memory",
    "kvsplice.cli.bench_decode": "kvsplice bench-decode", "kvsplice.cli.bench_balance": "kvsplice bench-balance",
    "kvsplice.cli.convert_llama2c": "kvsplice convert-llama2c", "training.export": "kvsplice export",
    "training.evaluate": "kvsplice evaluate",
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
    from kvsplice.cli.convert_llama2c import main

    model = tmp_path / "model.bin"
    model.write_bytes(os.urandom(64))
    before = snapshot(tmp_path)
    for out in (tmp_path, tmp_path / "sub" / ".."):
        rc = main([str(model), "--out", str(out), "--force"])
        one_error(rc, capsys.readouterr().err, "convert_llama2c", "contains the input model")
        assert snapshot(tmp_path) == before


def test_verify_memory_never_replaces_a_plot_without_force(tmp_path, capsys):
    from kvsplice.cli.verify_memory import main

    (tmp_path / "m.png").write_bytes(b"an earlier plot")
    rc = main(["--config", "gpt2", "--seq-lens", "8", "--json", str(tmp_path / "m.json"), "--no-progress"])
    one_error(rc, capsys.readouterr().err, "verify_memory", "m.png already exists (use --force")
    assert sorted(os.listdir(tmp_path)) == ["m.png"]


def test_evaluate_and_verify_memory_never_touch_a_checkpoint(tmp_path, data_cache, capsys):
    from kvsplice.cli.verify_memory import main as verify_memory
    from training.evaluate import main as evaluate

    ckpt = tiny_ckpt(tmp_path / "ok.ckpt", data_cache)
    before = snapshot(tmp_path)
    rc = evaluate(["--ckpt", str(ckpt), "--json", str(ckpt), "--force"])  # was: replaced by the JSON report
    one_error(rc, capsys.readouterr().err, "kvsplice evaluate", "is the input --ckpt")
    assert snapshot(tmp_path) == before
    bad = edit_ckpt(ckpt, tmp_path / "nan.ckpt", "model.transformer.wte.weight", torch.full((300, 32), float("nan")))
    rc = verify_memory(["--ckpt", str(bad), "--seq-lens", "8", "--no-progress"])
    one_error(rc, capsys.readouterr().err, "verify_memory", "tensor model.transformer.wte.weight holds 9600 NaN/inf")


def test_json_outputs_are_atomic_and_clean_up_after_killed_runs(tmp_path):
    from kvsplice.io.cli import UsageError
    from kvsplice.io.claims import release_claims
    from kvsplice.io.files import output_file
    from kvsplice.io.write import write_json

    out = tmp_path / "r.json"
    stale, other = tmp_path / f".r.json.{dead_pid()}.tmp", tmp_path / f".x.json.{dead_pid()}.tmp"
    stale.write_text("{")
    other.write_text("{")
    assert output_file(out, force=False, option="--json") == out.resolve()
    assert not stale.exists() and other.exists()  # only this output's temporaries
    write_json({"a": 1}, out)
    release_claims()  # a command's end (run_cli) releases its claim on the output
    assert out.read_text() == '{\n  "a": 1\n}\n' and sorted(os.listdir(tmp_path)) == [other.name, "r.json"]
    with pytest.raises(UsageError, match="already exists"):
        output_file(Path(os.path.relpath(out)), force=False, option="--json")


@pytest.mark.parametrize("module", sorted({*CLIS, "kvsplice.cli.plan", "kvsplice.cli.eval_tasks", "training.distill"}))
def test_help_is_shown_by_every_tool(module, capsys):
    """``kvsplice plan --help`` failed: a default holding ``50%-67%`` in its help."""
    rc = importlib.import_module(module).main(["--help"])
    out, err = capsys.readouterr()
    assert rc == 0 and "usage:" in out and "error" not in err, err


# ------------------------------------------------------------------------------------------ Ctrl-C
KVSPLICE_CLIS = {**{m: p for m, p in CLIS.items() if m.startswith("kvsplice.")}, "kvsplice.cli.plan": "kvsplice plan", "kvsplice.cli.eval_tasks": "kvsplice eval-tasks"}


@pytest.mark.parametrize("module", sorted(KVSPLICE_CLIS))
def test_ctrl_c_is_one_line_and_exit_130_in_every_tool(module, capsys, monkeypatch):
    from kvsplice.io.cli import EXIT_INTERRUPTED, Parser

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Parser, "parse_args", interrupted)
    rc = importlib.import_module(module).main(["--help"])
    err = capsys.readouterr().err
    assert rc == EXIT_INTERRUPTED == 130 and err == f"{KVSPLICE_CLIS[module]}: interrupted\n", err


def test_a_real_sigint_during_fit_bases_is_one_line_and_leaves_nothing(tmp_path, data_cache):
    """A SIGINT while ``fit_bases`` works (after its outputs were claimed, inside the calibration's forward timing):
    one line, exit 130, no output, temporary or claim left behind. The signal goes to the main thread
    (``pthread_kill``, called there), whose handler runs before the call returns: a process-wide ``kill`` may land on
    one of torch's threads and be handled only after the next line."""
    import subprocess
    import sys

    from hostile import tiny_hf_with_bases

    hf, _ = tiny_hf_with_bases(tmp_path, data_cache)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(["once upon a time there was a little dog who liked to run."] * 40))
    out = tmp_path / "out"
    out.mkdir()
    code = ("import signal, sys, threading; import kvsplice.cli.fit_bases as f\n"
            "def interrupt(*a, **k):\n    assert threading.current_thread() is threading.main_thread()\n"
            "    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)\n"
            "    raise SystemExit('not interrupted')\n"
            "f.time_forward = interrupt\n"
            f"sys.exit(f.main(['--model', {str(hf)!r}, '--method', 'ksvd', '--rank', '2', '--calib', {str(text)!r}, "
            f"'--calib-tokens', '128', '--seq-len', '32', '--no-progress', '--out', {str(out / 'b.safetensors')!r}, "
            f"'--json', {str(out / 'b.json')!r}, '--calib-stats', {str(out / 's.safetensors')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 130 and r.stderr == "kvsplice fit-bases: interrupted\n", (r.returncode, r.stderr[-3000:])
    assert os.listdir(out) == []


_HOLD_AT_TORCH = """
import importlib.abc, runpy, sys, time
from pathlib import Path

handshake, module = Path(sys.argv[1]), sys.argv[2]


class HoldAtTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":  # the heavy imports begin: say so, then wait there for Ctrl-C
            sys.meta_path.remove(self)
            handshake.write_text(module)
            while True:
                time.sleep(0.01)
        return None


sys.meta_path.insert(0, HoldAtTorch())
sys.argv = [module, "--help"]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def _interrupt_while_importing(module: str, tmp_path: Path) -> "subprocess.CompletedProcess[str]":
    """``python -m MODULE --help`` sent SIGINT while it imports torch: the process stops at the start of torch's
    import, says so in a handshake file and waits there, so the signal arrives inside the imports whatever the
    machine's speed or load (no timed poll)."""
    import signal
    import subprocess
    import sys

    handshake = tmp_path / f"{module}.importing"
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as o, open(err, "w") as e:  # files, not pipes: a full pipe would stall the child
        p = subprocess.Popen([sys.executable, "-c", _HOLD_AT_TORCH, str(handshake), module], cwd=REPO, stdout=o,
                             stderr=e, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            while not handshake.exists() and p.poll() is None:  # bounded by the child: it ends or writes the file
                threading.Event().wait(0.01)
            p.send_signal(signal.SIGINT)
            p.wait(timeout=120)
        finally:
            p.kill()
    return subprocess.CompletedProcess(p.args, p.returncode, out.read_text(), err.read_text())


@pytest.mark.parametrize("module", ["kvsplice.cli.eval_tasks", "kvsplice.cli.plan", "kvsplice.cli.to_mla"])
def test_ctrl_c_while_a_tool_imports_is_one_line_and_exit_130(module, tmp_path):
    """Ctrl-C in the first ~0.3 s (the heavy imports) was a KeyboardInterrupt traceback and exit -2."""
    r = _interrupt_while_importing(module, tmp_path)
    prog = KVSPLICE_CLIS.get(module) or prog_of(module)
    assert r.returncode == 130 and r.stderr == f"{prog}: interrupted\n", (r.returncode, r.stderr[-3000:])
    assert r.stdout == ""


# ------------------------------------------------------------------------------------------ claims
def test_a_second_run_to_the_same_new_output_is_refused(tmp_path, capsys):
    """A live process that claimed ``--json`` (through the same output rules) makes a second run refuse in one
    line, writing nothing; once it ends (killed: its claim file stays, its lock is gone) the run succeeds and
    removes the claim file."""
    import subprocess
    import sys

    from kvsplice.cli.verify_memory import main

    out, go = tmp_path / "m.json", tmp_path / "go"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, pathlib; from kvsplice.io.files import output_file\n"
        f"output_file({str(out)!r}, force=False, option='--json'); print('claimed', flush=True)\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.05)\n"
        "import os; os._exit(0)")],  # ends without releasing: a killed run's claim stays behind
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        args = ["--config", "gpt2", "--seq-lens", "8", "--json", str(out), "--no-progress"]
        rc = main(args)
        one_error(rc, capsys.readouterr().err, "verify_memory", f"is being written by another run (pid {holder.pid})")
        assert sorted(os.listdir(tmp_path)) == [".m.json.claim"]
    finally:
        go.touch()
        holder.wait(timeout=60)
    assert main(args) == 0, capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["go", "m.json", "m.png"]  # the claim was released at the command's end


def test_convert_llama2c_writes_every_file_with_the_umasks_mode(tmp_path, capsys):
    from kvsplice.cli.convert_llama2c import main

    stories = REPO.parent / "shared" / "data" / "stories260K"
    if not (stories / "stories260K.bin").is_file():
        pytest.skip("stories260K not found")
    umask = os.umask(0o022)
    try:
        assert main([str(stories / "stories260K.bin"), "--tokenizer", str(stories / "tok512.bin"), "--out",
                     str(tmp_path / "m")]) == 0, capsys.readouterr().err
    finally:
        os.umask(umask)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in (tmp_path / "m").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes


def test_bench_decode_never_writes_a_config_it_reads(tmp_path, capsys):
    from kvsplice.cli.bench_decode import main

    yaml = tmp_path / "tiny.yaml"
    shutil.copy(sorted((REPO / "configs").glob("*.yaml"))[0], yaml)
    before = snapshot(tmp_path)
    for opt in ("--json", "--plot"):
        rc = main(["--config", str(yaml), "--ctx", "8", "--batch", "1", "--repeats", "1", opt, str(yaml), "--force"])
        one_error(rc, capsys.readouterr().err, "bench_decode", f"is the input --config {yaml}")
    assert snapshot(tmp_path) == before
