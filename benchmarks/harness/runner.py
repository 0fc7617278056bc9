"""The one study runner. A study is settings (``benchmarks/studies/<name>.yaml``: named sizes) plus a function
yielding rows; the runner owns argv (``--size`` / ``--smoke``, ``--out``, ``--force``, ``--resume``, ``--threads``;
one error line, exit 2), the checks before anything runs (bounds, outputs), the header, resume and the atomic
writing of ``<stem>.json`` (after every row), ``.md`` and ``.png``. A script::

    STUDY = Study("prefill_speed", __doc__, rows, options=options, bounds={"lengths": (1, 1 << 17)})
    main = STUDY.main
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from benchmarks.harness import header as _header
from benchmarks.harness import report, studies
from benchmarks.harness.options import Parser, UsageError, add_threads, parser
from benchmarks.harness.paths import RESULTS, portable
from kvsplice.io.cli import run_cli
from kvsplice.io.write import check_writable

__all__ = ["Run", "Study", "check_bounds", "check_outputs", "write_atomic"]

MAX_THREADS = 4 * (os.cpu_count() or 1)
"""More torch threads than this is a typo, not a setting."""


@dataclass(frozen=True)
class Study:
    """What a benchmark script declares; :meth:`main` runs it as a command."""

    name: str  # the results stem (results/<name>[_<size>].*), settings file and program name
    doc: Optional[str]  # the script's __doc__: its help
    rows: Callable[["Run"], Iterable[dict]]  # yields the rows, each written to the JSON as it comes
    options: Optional[Callable[[Parser], None]] = None  # a dest naming a setting overrides it when given
    markdown: Optional[Callable[["Run", list], str]] = None  # <stem>.md (default: the YAML's report:)
    figure: Optional[Callable[["Run", list], Any]] = None  # a matplotlib figure (default: the YAML's figure:)
    summary: Optional[Callable[["Run", list], dict]] = None  # fields the JSON carries beside the rows
    bounds: dict = field(default_factory=dict)  # setting -> (low, high), every number of it checked first
    sizes: Optional[dict] = None  # named sizes (default: the YAML's sizes, or one empty default)
    out: Any = None  # the stem (default results/<name>, _<size> added), or a function of the options
    json: bool = True  # write <stem>.json (a figure-only study: False)
    threads: Optional[int] = 1  # --threads' default (None: no such option)
    default_size: str = "default"  # the size run without --size (its files have no _<size>)
    inherit: bool = True  # a named size overrides the default size's settings (False: complete in itself)

    def main(self, argv: Optional[Sequence[str]] = None) -> int:
        """Run the study as a command with ``argv`` (default: this process's arguments)."""
        return run_cli(self.name, lambda: _run(self, argv))

    def size_table(self) -> dict:
        """:attr:`sizes`, else the ``sizes`` of the study's YAML, else one empty ``default``."""
        return self.sizes if self.sizes is not None else self.spec("sizes") or {"default": {}}

    def files(self, stem: Path) -> list[Path]:
        """The files a run with ``stem`` writes."""
        md, png = self.markdown or self.spec("report"), self.figure or self.spec("figure")
        return [stem.with_name(stem.name + s) for s, on in ((".json", self.json), (".md", md), (".png", png)) if on]

    def spec(self, key: str) -> Optional[dict]:
        """The ``key`` section of the study's YAML (``report`` / ``figure``: :mod:`benchmarks.harness.report`)."""
        path = studies.STUDIES / f"{self.name}.yaml"
        return studies.load(self.name).get(key) if path.exists() else None


@dataclass
class Run:
    """One run of a study: what its rows function reads."""

    study: Study
    args: argparse.Namespace
    size: str
    settings: dict
    stem: Path
    header: dict
    done: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    notes: dict = field(default_factory=dict)  # what the rows found that the summary and report need
    _lock: Any = field(default_factory=threading.Lock, repr=False)
    _write: Optional[Callable[[bool], None]] = field(default=None, repr=False)
    failed: Optional[str] = None  # set by fail(): all is written, then exit status 1

    def emit(self, row: dict) -> None:
        """Add ``row`` now (thread-safe; the JSON rewritten), for a study whose rows come from jobs side by side."""
        with self._lock:
            self.rows.append(row)
            if self._write is not None:
                self._write(False)

    def fail(self, reason: str) -> None:
        """Mark the run failed: the results are written all the same, then one line and exit status 1."""
        self.failed = reason

    def __getitem__(self, key: str) -> Any:
        """A setting: ``run["lengths"]``."""
        return self.settings[key]

    def previous(self, **key: Any) -> Optional[dict]:
        """The row of the resumed JSON whose fields equal ``key`` (None: measure it)."""
        return next((row for row in self.done if all(row.get(k) == v for k, v in key.items())), None)

    @staticmethod
    def say(text: str) -> None:
        print(text, flush=True)


def check_bounds(settings: dict, bounds: dict) -> None:
    """Every number of each bounded setting within ``(low, high)``: a :class:`UsageError` naming the option."""
    for key, (lo, hi) in bounds.items():
        value = settings.get(key)
        for v in value if isinstance(value, (list, tuple)) else [] if value is None else [value]:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi
            if not ok:
                raise UsageError(f"--{key.replace('_', '-')}: must be in [{lo:g}, {hi:g}], got {v!r}")


def check_outputs(files: Iterable[Path], force: bool, keep: Iterable[Path] = ()) -> None:
    """Each output a regular file (or none yet) in a writable folder, not there already unless ``force`` or among
    ``keep`` (a resumed run's)."""
    keep = set(keep)
    for path in files:
        if path.name in ("", ".", "..") or path.is_dir():
            raise UsageError(f"{path}: is a folder (name a file)")
        if path.exists() or path.is_symlink():
            if path.is_symlink() or not path.is_file():
                raise UsageError(f"{path}: exists and is not a regular file")
            if not force and path not in keep:
                raise UsageError(f"{path}: exists (--force replaces it)")
        check_writable(path.parent, "--out", path)


def write_atomic(path: Path, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` into a temporary sibling renamed over ``path``: the old file or the whole new one (no torch
    imported, unlike :func:`models.checkpoint.atomic_write`: ``gpu_check --dry-run`` runs without it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _parser(study: Study, sizes: dict) -> Parser:
    p = parser(study.name + ".py", study.doc, raw=True)
    if study.options:
        study.options(p)
    g = p.add_argument_group("runner")
    if len(sizes) > 1:
        g.add_argument("--size", choices=sorted(sizes), default=study.default_size,
                       help=f"a named size of the study (default {study.default_size})")
    if "smoke" in sizes:
        g.add_argument("--smoke", dest="size", action="store_const", const="smoke", help="the smoke size")
    g.add_argument("--out", "--json", dest="out", type=Path, default=None,
                   help="the results' stem (default results/NAME[_SIZE]; a .json/.md/.png suffix is dropped)")
    g.add_argument("--tag", default="", help="results/NAME_TAG.* (default: the size's name, none for default)")
    g.add_argument("--force", action="store_true", help="replace existing outputs")
    if study.json:
        g.add_argument("--resume", action="store_true", help="continue the JSON of an earlier, stopped run")
    if study.threads is not None:
        add_threads(g, study.threads)
    return p


def _stem(study: Study, args: argparse.Namespace, size: str) -> Path:
    if args.out is not None:
        out = Path(args.out)
        if out.name in ("", ".", "..") or out.is_dir():
            raise UsageError(f"--out {out}: is a folder (name a file)")
    else:
        out = (study.out(args) if callable(study.out) else study.out) or RESULTS / study.name
        tag = args.tag or ("" if size == study.default_size else size)
        if not tag.replace("_", "").replace("-", "").isalnum() and tag:
            raise UsageError(f"--tag {tag!r}: letters, digits, '-' and '_' only")
        out = out.with_name(out.with_suffix("").name + (f"_{tag}" if tag else "") + out.suffix)
    return out.with_suffix("") if out.suffix in (".json", ".md", ".png") else out


def _resumed(study: Study, path: Path, args: argparse.Namespace) -> list:
    if not getattr(args, "resume", False) or not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot resume from it ({e})") from None
    legacy = isinstance(data, dict) and "study" not in data and "command" in data.get("meta", data)  # (pre-runner)
    if not isinstance(data, dict) or data.get("study", study.name if legacy else None) != study.name \
            or not isinstance(data.get("rows"), list):
        raise UsageError(f"{path}: not a {study.name} results file (cannot resume from it)")
    return [r for r in data["rows"] if isinstance(r, dict)]


def _run(study: Study, argv: Optional[Sequence[str]]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sizes = study.size_table()
    args = _parser(study, sizes).parse_args(argv)
    size = getattr(args, "size", study.default_size)
    settings = {**(sizes.get(study.default_size, {}) if study.inherit else {}), **sizes.get(size, {})}
    settings.update({k: v for k, v in vars(args).items() if k in settings and v is not None})
    check_bounds(settings, study.bounds)
    threads = getattr(args, "threads", None)
    if threads is not None and threads > MAX_THREADS:
        raise UsageError(f"--threads: at most {MAX_THREADS} on this machine, got {threads}")
    stem = _stem(study, args, size)
    files = study.files(stem)
    js = files[0] if study.json else None
    resuming = bool(getattr(args, "resume", False) and js and js.is_file())
    check_outputs(files, args.force, files if resuming else [])  # a resumed run rewrites its own report too
    done = _resumed(study, js, args) if js else []
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    head = _header.header(str(_header.ROOT / "benchmarks" / f"{study.name}.py"), argv, threads)
    run = Run(study, args, size, settings, stem, head, done)

    def write_json(complete: bool, extra: Optional[dict] = None) -> None:
        data = {**head, "study": study.name, "size": size, "settings": settings, "complete": complete,
                **(extra or {}), "rows": run.rows}
        text = json.dumps(portable(data), indent=1, default=str, allow_nan=True) + "\n"
        write_atomic(js, lambda tmp: tmp.write_text(text))

    run._write = write_json if js else None
    for row in study.rows(run):
        run.emit(row)
    extra = study.summary(run, run.rows) if study.summary else {}
    if js:
        write_json(True, extra)
    if study.markdown or study.spec("report"):
        text = (study.markdown(run, run.rows) if study.markdown
                else report.markdown(study.spec("report"), run.rows, {**settings, **extra, **run.notes})).rstrip("\n")
        text += f"\n\n*Made by `{head['command']}` (revision {head['revision']}; {_header.machine_line(threads)}).*\n"
        write_atomic(stem.with_name(stem.name + ".md"), lambda tmp: tmp.write_text(portable(text)))
    if study.figure or study.spec("figure"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = study.figure(run, run.rows) if study.figure else report.figure(study.spec("figure"), run.rows)
        write_atomic(stem.with_name(stem.name + ".png"), lambda tmp: fig.savefig(tmp, format="png"))
        plt.close(fig)
    for f in files:
        print(f"wrote {f}", flush=True)
    if run.failed:
        print(f"{study.name}: failed: {run.failed}", file=sys.stderr, flush=True)
        return 1
    return 0
