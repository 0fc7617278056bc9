"""Helpers of the tests that feed the tools hostile input (``test_cli.py``, ``test_bases_files.py``, ``test_fit_*.py``,
``test_export.py``, the tools' own test files): the one-line error check, folder snapshots, a pid that is surely
dead, a destination no process can write, and tiny checkpoints with a real (synthetic) tokenizer."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from models import GPT
from models.checkpoint import save_model
from models.config import GPTConfig
from tiny_models import sharpen

REPO = Path(__file__).resolve().parents[1]
STORIES260K = REPO.parent / "shared" / "data" / "stories260K"
"""The real llama2.c checkpoint stories260K and its tokenizer (tests that use it skip without it)."""


def prog_of(tool: str) -> str:
    """The program name a command's error lines start with: ``kvsplice VERB`` for a tool named by its verb
    (``to-mla``), its module's last part (``to_mla``) or the whole prefix (``kvsplice to-mla``)."""
    return tool if tool.startswith("kvsplice ") else "kvsplice " + tool.rsplit(".", 1)[-1].replace("_", "-")


def one_error(rc: int, err: str, prog: str, expect: str = "") -> str:
    """The command exited 2 with exactly one ``PROG: error: ...`` line and no traceback, containing ``expect``;
    ``note:`` lines are allowed. Lines are what a terminal shows (a progress bar overwritten through ``\\r`` is gone).
    ``prog``: as :func:`prog_of` takes it."""
    prog = prog_of(prog)
    assert "Traceback" not in err, err
    shown = [ln.rsplit("\r", 1)[-1] for ln in err.split("\n")]  # what a terminal shows: a cleared progress bar is gone
    lines = [ln for ln in shown if ln.strip() and "warning" not in ln.lower() and not ln.startswith("note:")]
    prefix = f"{prog}: error: "
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(prefix), (rc, err)
    assert expect in lines[0], (expect, lines[0])
    return lines[0]


def run_tool(main: Callable[[list[str]], int], argv: list, capsys) -> tuple[int, str, str]:
    """A command's ``main`` run on ``argv`` (each item as a string): its exit status, stdout and stderr."""
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture(scope="module")
def s260k(tmp_path_factory) -> str:
    """stories260K converted to a model folder once per test module (its path)."""
    from kvsplice.convert.llama2c import convert_llama2c

    return str(convert_llama2c(STORIES260K / "stories260K.bin", STORIES260K / "tok512.bin",
                               tmp_path_factory.mktemp("s")))


def snapshot(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``folder`` (hidden ones included)."""
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _writable(folder: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


@pytest.fixture
def readonly_dir(tmp_path) -> Path:
    """A folder where creating a file fails: a ``chmod 555`` folder, or — for root, whom permission bits do not
    stop — sysfs's root (checked, else the test is skipped)."""
    d = tmp_path / "readonly"
    d.mkdir()
    d.chmod(0o555)
    try:
        if not _writable(d):
            yield d
        elif Path("/sys").is_dir() and not _writable(Path("/sys")):
            yield Path("/sys")
        else:
            pytest.skip("no read-only folder available")
    finally:
        d.chmod(0o755)


def tiny_data(cache_dir: Path) -> dict[str, Any]:
    """Data settings of the embedded synthetic stories with a 300-token BPE (built once per cache folder)."""
    return dict(synthetic=True, synthetic_stories=300, synthetic_vocab_size=300, cache_dir=str(cache_dir))


def tiny_ckpt(path: Path, cache_dir: Path, seed: int = 0, **cfg: Any) -> Path:
    """A tiny GPT checkpoint (MHA unless ``cfg`` says otherwise) whose data settings rebuild a real tokenizer."""
    torch.manual_seed(seed)
    config = GPTConfig(**{**dict(vocab_size=300, n_layer=2, n_head=2, d_model=32, block_size=64, d_latent=16), **cfg})
    return save_model(sharpen(GPT(config), std=0.2, seed=seed), path, data_hparams=tiny_data(cache_dir))


def edit_ckpt(src: Path, dst: Path, name: str, value: torch.Tensor) -> Path:
    """A copy of checkpoint ``src`` with ``state_dict[name]`` replaced by ``value``."""
    ckpt = torch.load(src, weights_only=True)
    ckpt["state_dict"][name] = value
    torch.save(ckpt, dst)
    return dst


def tiny_hf_with_bases(folder: Path, cache_dir: Path) -> tuple[Path, Path]:
    """``(hf, bases)``: a tiny GPT-2 folder with its tokenizer (a ``training.export`` of :func:`tiny_ckpt`) and
    valid rank-4 post-RoPE bases for it."""
    import transformers

    from test_hf_cache import random_bases
    from training.export import export

    export(tiny_ckpt(folder / "mha.ckpt", cache_dir), folder / "hf")
    bases = random_bases(transformers.GPT2LMHeadModel.from_pretrained(folder / "hf"), 4, "post", seed=1)
    return folder / "hf", bases.save(folder / "r4.safetensors")


# ------------------------------------------------------------------------------------------------ disks and Ctrl-C
@contextlib.contextmanager
def small_disk(folder: Path, size: int = 64 * 1024):
    """``folder`` as a tmpfs of ``size`` bytes (a disk that fills: writes past it fail with ENOSPC), unmounted at
    the end; the test is skipped where mounting is not permitted (not root, no CAP_SYS_ADMIN)."""
    folder.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({(r.stderr or r.stdout).strip()[:80]})")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=timeout)


def interrupt_at_exit(module: str, argv: list) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGV`` that gets Ctrl-C (SIGINT, raised in its main thread: deterministic) once the
    command has ended, while the interpreter shuts down."""
    code = ("import atexit, runpy, signal, sys\n"
            "atexit.register(signal.raise_signal, signal.SIGINT)\n"
            f"sys.argv = [{module!r}] + {[str(a) for a in argv]!r}\n"
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    return _python(code)


def interrupt_on_import(module: str, argv: list, trigger: str = "torch") -> subprocess.CompletedProcess:
    """``python -m MODULE ARGV`` that gets Ctrl-C (raised in its main thread) at the moment it first imports
    ``trigger`` — during its imports, deterministically."""
    code = ("import runpy, signal, sys\n"
            "class Trip:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name == {trigger!r}:\n"
            "            sys.meta_path.remove(self)\n"
            "            signal.raise_signal(signal.SIGINT)\n"
            "        return None\n"
            "sys.meta_path.insert(0, Trip())\n"
            f"sys.argv = [{module!r}] + {[str(a) for a in argv]!r}\n"
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    return _python(code)


def one_interrupt(r: subprocess.CompletedProcess, prog: str) -> None:
    """Exit status 130 and exactly one ``PROG: interrupted`` line, no traceback."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("note:")
             and "warning" not in ln.lower()]
    assert r.returncode == 130 and lines == [f"{prog_of(prog)}: interrupted"], (r.returncode, r.stderr)
