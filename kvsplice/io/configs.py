"""Model configs for the tools: a :class:`~models.config.GPTConfig` from a preset name, a training YAML, or the
stem of a YAML under the package's ``configs/`` directory (:data:`models.config.CONFIG_DIR`). Besides what
:meth:`GPTConfig.from_file` reads, a YAML may name a ``preset:`` plus field overrides or nest the fields one level."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvsplice.io.cli import UsageError
from models.config import CONFIG_DIR, PRESETS, GPTConfig, available_configs, preset

__all__ = ["config_from_yaml", "resolve_config"]


def config_from_yaml(path: str | Path) -> GPTConfig:
    """A GPTConfig from the ``model:`` section of a LightningCLI YAML (other sections and non-GPTConfig keys, e.g.
    optimizer settings, are ignored). ``model: {class_path, init_args: {...}}`` and a nested dict of GPTConfig
    fields (``model: {config: {...}}``) are accepted too, and so is ``preset: NAME`` plus field overrides.
    Missing fields take GPTConfig's defaults (``vocab_size`` 50304)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise UsageError(f"{path}: no 'model:' section with GPTConfig fields")
    if isinstance(model.get("init_args"), dict):
        model = model["init_args"]
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    picked = {k: v for k, v in model.items() if k in fields}
    if not picked:  # e.g. model: {config: {n_layer: ..., ...}}
        for v in model.values():
            v = v.get("init_args", v) if isinstance(v, dict) else v
            if isinstance(v, dict) and set(v) & fields:
                model, picked = v, {k: x for k, x in v.items() if k in fields}
                break
    base = model.get("preset")
    if not picked and not isinstance(base, str):
        raise UsageError(f"{path}: the 'model:' section has no GPTConfig fields (known: {sorted(fields)})")
    try:
        if isinstance(base, str):
            return preset(base, **picked)
        return GPTConfig(**picked)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{path}: {e}") from None


def resolve_config(spec: str) -> tuple[str, GPTConfig, str]:
    """``(label, cfg, source)`` for a preset name, a YAML path, or the stem of a YAML under ``configs/``."""
    if spec in PRESETS:
        return spec, preset(spec), f"preset:{spec}"
    p = Path(spec)
    candidates = [p] if (p.suffix in (".yaml", ".yml") or p.exists()) else []
    candidates += [CONFIG_DIR / f"{spec}.yaml", CONFIG_DIR / f"{spec}.yml"]
    for c in candidates:
        if c.is_file():
            return c.stem, config_from_yaml(c), f"yaml:{c}"
    if p.suffix in (".yaml", ".yml"):
        raise UsageError(f"config file not found: {spec}")
    raise UsageError(f"unknown config {spec!r}: not a preset ({', '.join(sorted(PRESETS))}) nor a YAML file "
                     f"(configs/: {', '.join(available_configs()) or 'none'})")
