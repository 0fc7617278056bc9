"""Ctrl-C is one ``kvsplice VERB: interrupted`` line and exit status 130 from the command's first instruction to its
last: while the console command imports its first modules (before any verb is known), and once a verb has ended —
while the exit handlers run and until the process is gone (the interpreter's teardown restores the default SIGINT
action: a Ctrl-C there killed the process without a line). Each SIGINT is raised in the main thread at a chosen
moment (an import, an exit handler, the teardown), never after a delay. SIGTERM (``kill``) is one ``kvsplice VERB: terminated`` line and exit status 143, its
claims released."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from hostile import REPO, STORIES260K, one_interrupt
from kvsplice.io.interrupt import program_name

pytestmark = pytest.mark.timeout(300)

CONSOLE = ("import sys\n"
           "sys.argv = ['/usr/local/bin/kvsplice'] + {argv!r}\n"
           "from kvsplice.cli.main import main\n"  # what the console script runs
           "sys.exit(main())\n")
TRIP = ("import signal, sys\n"
        "class Trip:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == {trigger!r}:\n"
        "            sys.meta_path.remove(self)\n"
        "            signal.raise_signal(signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Trip())\n")
LATE = ("import atexit, os, signal, sys\n"
        "class Late:\n"
        "    def __del__(self):\n"  # the interpreter's teardown, after the exit handlers
        "        signal.raise_signal(signal.SIGINT)\n"
        "late = Late()\n")
AT_EXIT = "import atexit, signal\natexit.register(signal.raise_signal, signal.SIGINT)\n"


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=280)


@pytest.mark.parametrize("argv,expect", [
    (["/x/bin/kvsplice", "plan", "--ratio", "4"], "kvsplice plan"),
    (["/x/bin/kvsplice"], "kvsplice"),
    (["/x/bin/kvsplice", "--help"], "kvsplice"),
])
def test_the_console_command_is_recognised(argv, expect):
    assert program_name(argv, ["python", argv[0], *argv[1:]]) == expect


def test_module_forms_and_other_programs():
    assert program_name(["/r/kvsplice/cli/plan.py"], ["python", "-m", "kvsplice.cli.plan"]) is None  # a verb's module
    assert program_name(["/r/kvsplice/plan.py"], ["python", "-m", "kvsplice.plan"]) is None  # no such form
    assert program_name(["/r/kvsplice/cli/main.py", "to-mla"], ["python", "-m", "kvsplice.cli.main", "to-mla"]) \
        == "kvsplice to-mla"
    assert program_name(["/r/pytest"], ["python", "-m", "pytest", "-x"]) is None
    assert program_name(["script.py"], ["python", "script.py"]) is None
    assert program_name(["-c"], ["python", "-c", "import kvsplice"]) is None


def test_ctrl_c_while_the_console_command_imports_its_first_module():
    """The SIGINT lands when ``kvsplice.cli.main`` imports ``dataclasses`` — before any verb is loaded."""
    r = _python(TRIP.format(trigger="dataclasses") + CONSOLE.format(argv=["to-gguf", "--help"]))
    one_interrupt(r, "kvsplice to-gguf")


@pytest.fixture(scope="module")
def llama2c_args():
    bin_ = STORIES260K / "stories260K.bin"
    if not bin_.is_file():
        pytest.skip("stories260K not found")
    return ["convert-llama2c", str(bin_)]


def test_ctrl_c_in_an_exit_handler_after_the_command_is_one_line(llama2c_args, tmp_path):
    out = tmp_path / "o"
    r = _python(AT_EXIT + CONSOLE.format(argv=[*llama2c_args, "--out", str(out)]))
    one_interrupt(r, "kvsplice convert-llama2c")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_ctrl_c_in_the_teardown_after_the_command_never_kills_it_silently(llama2c_args, tmp_path):
    """Python's teardown restores the default SIGINT action before it destroys objects: a Ctrl-C there killed the
    process (exit -2, no line). The command now ends the process once its exit handlers ran: the teardown never
    comes, the status is the command's own."""
    out = tmp_path / "o"
    r = _python(LATE + CONSOLE.format(argv=[*llama2c_args, "--out", str(out)]))
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert (out / "config.json").is_file()
    r = _python(LATE + CONSOLE.format(argv=[*llama2c_args, "--out", str(out)]))  # exists: refused, exit 2
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not empty" in r.stderr, (r.returncode, r.stderr)


HOLD = ("import time, kvsplice.io.claims as claims\n"
        "real = claims.claim\n"
        "def claim_and_wait(*a, **k):\n"  # the verb claims its output, says so, and waits for the SIGTERM
        "    real(*a, **k)\n"
        "    print('claimed', flush=True)\n"
        "    time.sleep(60)\n"
        "claims.claim = claim_and_wait\n")


def test_sigterm_while_a_verb_holds_its_claim_releases_it(llama2c_args, tmp_path):
    """``kill`` (SIGTERM) on a running verb: one ``kvsplice VERB: terminated`` line, exit status 143 (128 + 15), and
    no ``.claim`` file left beside the output (the default action killed the process before its claims were
    released)."""
    out = tmp_path / "o"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = HOLD + CONSOLE.format(argv=[*llama2c_args, "--out", str(out)])
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=REPO, env=env)
    try:
        assert p.stdout.readline().strip() == "claimed"
        assert [f.name for f in tmp_path.iterdir() if f.name.endswith(".claim")] == [".o.claim"]
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 143 and err == "kvsplice convert-llama2c: terminated\n", (p.returncode, err)
    assert not [f.name for f in tmp_path.iterdir() if f.name.endswith(".claim")]
