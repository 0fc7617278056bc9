"""The header every result records: the exact command that made it, the machine and the code's revision."""

from __future__ import annotations

import importlib
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.harness.paths import ROOT

__all__ = ["command", "device_tag", "header", "machine", "machine_line", "revision", "version"]


def command(script: str, argv: Optional[Sequence[str]] = None) -> str:
    """``python -m benchmarks.<study> ARGS``: the command that ran ``script`` with ``argv`` (default: this process's),
    shell-quoted (a file outside the repository: by its path)."""
    path = Path(script).resolve()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        module = path.relative_to(ROOT).with_suffix("").parts
    except ValueError:
        return shlex.join(["python", path.name, *map(str, args)])
    return shlex.join(["python", "-m", ".".join(module), *map(str, args)])


def device_tag(name: str) -> str:
    """A file-name-safe device tag: ``NVIDIA H100 80GB HBM3`` -> ``h100``; others lower-cased, ``_``-joined."""
    m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name.upper().replace("NVIDIA", " "))
    if m:
        return m.group(1).lower()
    tag = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return tag[:40] or "device"


def machine(threads: Optional[int] = None) -> dict:
    """The processor, cores, Python / torch versions, torch threads, CUDA device and load average."""
    out: dict = {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                 "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__
        out["threads"] = threads if threads is not None else torch.get_num_threads()
        if torch.cuda.is_available():
            out["cuda_device"] = torch.cuda.get_device_name()
            out["cuda"] = torch.version.cuda
    if hasattr(os, "getloadavg"):
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return out


def machine_line(threads: Optional[int] = None) -> str:
    """:func:`machine` as a line: ``x86_64, 16 cores, torch 2.5.1, 1 torch thread(s); load average 1.2 / 1.0 / 0.9``."""
    m = machine(threads)
    parts = [str(m["processor"]), f"{m['cores']} cores"]
    if "torch" in m:
        parts += [f"torch {m['torch']}", f"{m['threads']} torch thread(s)"]
    parts += [m["cuda_device"]] if "cuda_device" in m else []
    load = " / ".join(f"{x:.1f}" for x in m.get("load_average", []))
    return ", ".join(parts) + (f"; load average {load}" if load else "")


def revision() -> Optional[str]:
    """The checkout's commit (``+dirty`` when files differ from it), or None outside a git checkout."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def version(module: str) -> Optional[str]:
    """``module.__version__``, or None where it does not import (a device machine may lack it)."""
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001 - a broken install reads as a missing one
        return None


def header(script: str, argv: Optional[Sequence[str]] = None, threads: Optional[int] = None) -> dict:
    """``{"command", "machine", "revision"}`` of a run of ``script`` with ``argv``."""
    return {"command": command(script, argv), "machine": machine(threads), "revision": revision()}
