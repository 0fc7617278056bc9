"""The one table of old key names (:mod:`models.compat`): what it renames, and that docs/training.md lists it."""

from __future__ import annotations

import dataclasses
import re

import pytest

from hostile import REPO
from models.compat import MEANING, OLD_NAMES, old_name_note, rename_old_keys
from models.config import GPTConfig


def test_each_old_key_names_a_field_and_a_meaning():
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    assert set(OLD_NAMES) == set(MEANING) and set(OLD_NAMES.values()) <= fields and not set(OLD_NAMES) & fields
    assert old_name_note("kvsplice_ratio", 0.1).startswith("kvsplice_ratio is the old name of kvsplice_keep (")


def test_rename_reads_the_old_key_as_the_new_one():
    assert rename_old_keys({"kvsplice_ratio": 0.1, "d_latent": 8}) == {"kvsplice_keep": 0.1, "d_latent": 8}
    assert rename_old_keys({"kvsplice_ratio": None, "kvsplice_keep": 0.5}) == {"kvsplice_keep": 0.5}  # not given
    assert rename_old_keys({"kvsplice_ratio": 0.1, "kvsplice_keep": None}) == {"kvsplice_keep": 0.1}
    assert rename_old_keys({"kvsplice_ratio": 0.1, "kvsplice_keep": 0.5}, new_wins=True) == {"kvsplice_keep": 0.5}
    with pytest.raises(ValueError, match="^f.yaml: kvsplice_ratio is the old name of kvsplice_keep; give only"):
        rename_old_keys({"kvsplice_ratio": 0.1, "kvsplice_keep": 0.5}, "f.yaml")


def test_the_docs_table_lists_the_table():
    text = (REPO / "docs" / "training.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| `(\w+)` \|", text, re.M))
    assert rows == OLD_NAMES


def test_a_converted_folders_old_absorbed_spelling_reads_as_the_trained_familys():
    """``MLALlamaConfig`` spells the absorbed decode path as :class:`GPTConfig` does (``absorb``); a folder written
    with ``absorbed`` loads as ``absorb``, and nothing else is accepted."""
    from models.mla_llama import MLALlamaConfig

    base = dict(vocab_size=32, d_model=16, n_layer=1, n_head=2, n_kv_head=1, head_dim=8, d_ff=32, d_latent=4,
                rope_dims=4)
    assert MLALlamaConfig.from_dict({**base, "mla_impl": "absorbed"}).mla_impl == "absorb"
    assert MLALlamaConfig.from_dict({**base, "mla_impl": "naive"}).mla_impl == "naive"
    with pytest.raises(ValueError, match="mla_impl must be one of"):
        MLALlamaConfig(**base, mla_impl="absorbed")
