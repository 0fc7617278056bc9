"""The one reader of YAML a user gives (training configs, ``--config`` of the training and measuring commands, the
values jsonargparse parses): refuses in one line what PyYAML's ``safe_load`` accepts but no config needs.

* a file that is not a small regular file (a FIFO would block, ``/dev/zero`` never ends): :data:`MAX_YAML_BYTES`;
* more than :data:`MAX_ALIASES` aliases (``*name``): a "billion laughs" document expands exponentially in whatever
  walks it (jsonargparse, a dump), so it is refused before it is built;
* a key given twice in one mapping (PyYAML keeps the last one silently); YAML merge keys (``<<``) are not duplicates.

Errors are :class:`YamlRefused` (a ``ValueError``) whose message is one line naming the file and, for a duplicate
key, the key and its line.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Optional, Union

import yaml

__all__ = ["MAX_ALIASES", "MAX_YAML_BYTES", "YamlRefused", "check_yaml", "load_yaml", "load_yaml_file",
           "read_text_file"]

MAX_YAML_BYTES = 1 << 22
"""A config larger than 4 MiB is no config (never read)."""
MAX_ALIASES = 64
"""Aliases one document may use; enough for any config, far too few for an exponential expansion."""
_MERGE = "tag:yaml.org,2002:merge"


class YamlRefused(ValueError):
    """A YAML input refused: one line naming the file (or ``value``) and why."""


class _Checker(yaml.SafeLoader):
    """Composes the node graph only (nothing is constructed), counting aliases as it goes."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise YamlRefused(f"more than {MAX_ALIASES} YAML aliases (line {mark.line + 1}): refused, as a "
                                  f"'billion laughs' document would expand without end")
        return super().compose_node(parent, index)


def _duplicate_key(node: Optional[yaml.Node]) -> Optional[tuple[str, int]]:
    """The first key given twice in one mapping of ``node``'s graph (``(key, line)``), each node visited once."""
    seen_nodes: set[int] = set()
    todo = [node] if node is not None else []
    while todo:
        n = todo.pop()
        if id(n) in seen_nodes:
            continue
        seen_nodes.add(id(n))
        if isinstance(n, yaml.MappingNode):
            keys: set[tuple[str, str]] = set()
            for k, v in n.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != _MERGE:
                    if (k.tag, k.value) in keys:
                        return k.value, k.start_mark.line + 1
                    keys.add((k.tag, k.value))
                todo += [k, v]
        elif isinstance(n, yaml.SequenceNode):
            todo += list(n.value)
    return None


def check_yaml(text: str, where: str = "value") -> None:
    """Refuse ``text`` (:class:`YamlRefused`, naming ``where``) when it uses more than :data:`MAX_ALIASES` aliases
    or repeats a key in one mapping; YAML syntax errors are PyYAML's ``YAMLError``, raised unchanged."""
    loader = _Checker(text)
    try:
        node = loader.get_single_node()
    except YamlRefused as e:
        raise YamlRefused(f"{where}: {e}") from None
    finally:
        loader.dispose()
    dup = _duplicate_key(node)
    if dup is not None:
        raise YamlRefused(f"{where}: the key {dup[0]!r} is given twice in one mapping (line {dup[1]}); keep one")


def load_yaml(text: str, where: str = "value") -> Any:
    """``yaml.safe_load(text)`` after :func:`check_yaml`."""
    check_yaml(text, where)
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def read_text_file(path: Union[str, "os.PathLike[str]"], limit: int = MAX_YAML_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes; a FIFO, device or larger file is an ``OSError``
    / :class:`YamlRefused` before any byte is read (opened without blocking, checked again once open)."""
    p = Path(path).expanduser()
    st = os.stat(p)
    if not stat.S_ISREG(st.st_mode):
        raise YamlRefused(f"{p}: not a regular file (a FIFO, device or folder)")
    if st.st_size > limit:
        raise YamlRefused(f"{p}: {st.st_size:,} bytes, larger than any config ({limit:,})")
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise YamlRefused(f"{p}: not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise YamlRefused(f"{p}: larger than any config ({limit:,} bytes)")
    return data.decode("utf-8")


def load_yaml_file(path: Union[str, "os.PathLike[str]"]) -> Any:
    """The document of a YAML file a user gives: :func:`read_text_file`, then :func:`load_yaml`. Raises
    ``OSError`` (cannot read), ``UnicodeDecodeError``, ``yaml.YAMLError`` or :class:`YamlRefused`."""
    return load_yaml(read_text_file(path), str(path))
