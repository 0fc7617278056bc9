"""Model configs for the tools: a :class:`~models.config.GPTConfig` from a config name (the stem of a YAML under the
package's ``configs/`` directory, :data:`models.config.CONFIG_DIR`; the 124M presets are such YAMLs) or a YAML path.
One reader: :meth:`GPTConfig.from_file`, the one ``training.fit`` trains from."""

from __future__ import annotations

from pathlib import Path

from kvsplice.io.cli import UsageError
from models.config import ConfigNotFoundError, GPTConfig, config_path

__all__ = ["named_config"]


def named_config(spec: str) -> tuple[str, GPTConfig, str]:
    """``(label, cfg, source)`` for a config name (``gpt2``, ``mla_kvsplice_90``, ``small_mla``...) or a YAML path:
    the ``model:`` section exactly as ``python -m training.fit --config SPEC`` reads it (``vocab_size`` 50304 unless
    the file sets it: a training run links it from its tokenizer)."""
    p = Path(spec)
    if (p.suffix in (".yaml", ".yml") or len(p.parts) > 1) and not p.is_file():
        raise UsageError(f"config file not found: {spec}")
    try:
        path = config_path(spec)
    except ConfigNotFoundError as e:
        raise UsageError(f"unknown config: {e}") from None
    try:
        return Path(path).stem, GPTConfig.from_file(path), f"yaml:{path}"
    except ValueError as e:
        raise UsageError(str(e)) from None
