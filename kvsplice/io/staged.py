"""Outputs that replace earlier ones only when a run completes: each is written (and rewritten, as progress) at its
temporary name ``.<name>.<pid>.tmp`` beside it, and every one is renamed into place together at the end.

    with Staged([out, report]) as st:
        write_json(progress, st.temp(out))     # as often as the run likes; ``out`` keeps the earlier result
        write_json(final, st.temp(out)); write_json(rep, st.temp(report))
        st.commit()                            # the renames, Ctrl-C held off until they are done

A run stopped before :meth:`Staged.commit` (Ctrl-C, an error) leaves every earlier output as it was and removes its
temporaries; a killed one leaves them to :func:`models.checkpoint.remove_stale_temp_files`, which every output check
(:func:`kvsplice.io.files.output_file`) runs. The temporary names are the ones :func:`models.checkpoint.atomic_write`
uses: hidden, tagged with the writer's pid, never a user's file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Iterable, Iterator, Union

from models.checkpoint import temp_path

__all__ = ["Staged", "held_interrupts"]


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """Ctrl-C (SIGINT) during the block is held and raised as ``KeyboardInterrupt`` when it ends (on the main
    thread; elsewhere the block runs as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if got:
        raise KeyboardInterrupt


class Staged:
    """Outputs written at their temporary names and renamed into place together (see the module docstring)."""

    def __init__(self, paths: Iterable[Union[str, Path]]) -> None:
        self._temps = {Path(p): temp_path(Path(p)) for p in paths}
        self.committed = False

    def temp(self, path: Union[str, Path]) -> Path:
        """Where ``path`` is written until :meth:`commit`."""
        return self._temps[Path(path)]

    def commit(self) -> None:
        """Rename every written temporary over its output (Ctrl-C held until all are renamed)."""
        with held_interrupts():
            for path, tmp in self._temps.items():
                if tmp.exists():
                    os.replace(tmp, path)
            self.committed = True

    def discard(self) -> None:
        """Remove the temporaries (the earlier outputs stay)."""
        for tmp in self._temps.values():
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> "Staged":
        return self

    def __exit__(self, *exc) -> None:
        if not self.committed:
            self.discard()
