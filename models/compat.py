"""Old spellings users may still have in files: a key of a config's ``model:`` section, of a checkpoint's stored
config (``gpt_config``) or of its hyper-parameters, written under a :class:`models.GPTConfig` field's earlier name;
a converted MLA folder's weights naming its projections ``kv_down`` / ``k_up`` / ``v_up``
(:data:`OLD_WEIGHT_NAMES`, applied by :func:`kvsplice.loading.mla_folder.load_mla_folder`) and its config's
``mla_impl: absorbed`` (:data:`OLD_VALUES`, applied by :meth:`models.mla_llama.MLALlamaConfig.from_dict`).

:data:`OLD_NAMES` is the one table of config keys. It is applied where those are read — :meth:`GPTConfig.from_dict` (checkpoints),
:meth:`GPTConfig.from_file` (YAML, with a note), the training command's ``model:`` section and checkpoint
hyper-parameters (:class:`training.lit.LitGPT`) — and nowhere else: code uses the new names only, and nothing
writes an old one (docs/training.md lists the table).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MEANING", "OLD_NAMES", "OLD_VALUES", "OLD_WEIGHT_NAMES", "current_value", "current_weight_name",
           "old_name_note", "rename_old_keys"]

OLD_NAMES: dict[str, str] = {"kvsplice_ratio": "kvsplice_keep"}
"""Old key -> the field it is now."""
MEANING: dict[str, str] = {
    "kvsplice_ratio": "the fraction of the latent kept: 0.1 keeps 10 %, the KVSplice-90 model; 'ratio' elsewhere "
                      "means times smaller",
}
"""Old key -> the one line a note about it says."""

OLD_WEIGHT_NAMES: dict[str, str] = {".attn.kv_down.": ".attn.w_dkv.", ".attn.k_up.": ".attn.w_uk.",
                                    ".attn.v_up.": ".attn.w_uv."}
"""Old part of an MLA folder's weight name -> the name the trained family uses (down projection ``w_dkv``, key and
value up projections ``w_uk`` / ``w_uv``)."""


OLD_VALUES: dict[tuple[str, Any], Any] = {("mla_impl", "absorbed"): "absorb"}
"""``(key, old value) -> value``: a converted MLA folder's ``config.json`` that spelt the absorbed decode path as the
trained family's ``mla_impl`` does not."""


def current_value(key: str, value: Any) -> Any:
    """``value`` of ``key``, an old spelling (:data:`OLD_VALUES`) replaced."""
    try:
        return OLD_VALUES.get((key, value), value)
    except TypeError:  # an unhashable value (a list, a dict) has no old spelling
        return value


def current_weight_name(name: str) -> str:
    """``name`` with an old MLA projection name (:data:`OLD_WEIGHT_NAMES`) replaced."""
    for old, new in OLD_WEIGHT_NAMES.items():
        name = name.replace(old, new)
    return name


def old_name_note(old: str, value: Any) -> str:
    """The one-line note for a key given by its old name."""
    new = OLD_NAMES[old]
    return f"{old} is the old name of {new} ({MEANING[old]}); read as {new}: {value}"


def rename_old_keys(d: dict, where: str = "GPTConfig", *, new_wins: bool = False) -> dict:
    """``d`` (a copy) with its old keys under their new names; an old key that is ``None`` (not given) is dropped.
    ``new_wins``: an old key beside its new name (set, not ``None``) is dropped (the training command has noted it).

    Raises:
        ValueError: both the old and the new name, with different values, without ``new_wins`` (``where`` starts
            the message).
    """
    out = dict(d)
    for old, new in OLD_NAMES.items():
        value = out.pop(old, None)
        if value is None:
            continue
        if out.get(new) is None:
            out[new] = value
        elif out[new] != value and not new_wins:
            raise ValueError(f"{where}: {old} is the old name of {new}; give only {new} (got {old}={value!r}, "
                             f"{new}={out[new]!r})")
    return out
