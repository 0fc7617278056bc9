"""The ``kvsplice`` console command (:mod:`kvsplice.cli.main`): the verb listing without torch, one-line errors,
every verb reachable."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hostile import REPO
from kvsplice.cli import main as front


def test_main_help_lists_every_verb_one_line_each(capsys):
    assert front.main(["--help"]) == 0
    out = capsys.readouterr().out
    for verb, v in front.VERBS.items():
        [line] = [ln for ln in out.splitlines() if ln.startswith("  ") and ln.split()[0] == verb]
        assert v.summary in line


def test_main_help_does_not_import_torch():
    code = "import sys; from kvsplice.cli.main import main; main(['--help']); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "False", r.stdout + r.stderr


def test_main_unknown_verb_is_one_line_exit_2(capsys):
    assert front.main(["tarin"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvsplice: error: unknown verb 'tarin'") and "train" in err


@pytest.mark.parametrize("verb", sorted(front.VERBS))
def test_main_runs_each_verb_and_its_help(verb, capsys):
    """Every verb's module loads and answers ``--help`` with exit 0, naming itself ``kvsplice VERB``."""
    rc = front.main([verb, "--help"])
    out = capsys.readouterr().out
    assert rc == 0 and "usage:" in out.lower(), out[-2000:]
    if not front.VERBS[verb].module.startswith("training.fit"):  # LightningCLI prints its own program name
        assert f"kvsplice {verb}" in out


def test_main_leaves_python_sigint_handling_as_it_was(capsys):
    """The front door's quiet Ctrl-C while a verb imports ends with the verb: the default handler is back."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    for verb in sorted(front.VERBS):
        front.main([verb, "--help"])
        assert signal.getsignal(signal.SIGINT) is before, verb
    capsys.readouterr()


def test_console_script_is_declared():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"kvsplice": "kvsplice.cli.main:main"}


def test_main_as_the_program_runs_the_verb_with_its_error_line():
    """``kvsplice VERB ...`` as a process (the console command's code path): the verb's one error line, exit 2."""
    r = subprocess.run([sys.executable, "-m", "kvsplice.cli.main", "to-gguf", "--no-such-option"], capture_output=True,
                       text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("kvsplice to-gguf: error:") and r.stderr.count("\n") == 1, r.stderr
