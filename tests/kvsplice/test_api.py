"""The Python API from ``kvsplice`` itself: every name the reference page lists, plus the loader every command uses,
the planner's ``Plan`` and ``perplexity`` — importable by name, each the object of its home module."""

from __future__ import annotations

import importlib

import pytest

import kvsplice

# the names docs/reference.md's API table listed when the package gained its front door, plus load_model / Plan
API = ["GPT", "GPTConfig", "preset", "GraphDecoder", "decode_attend", "CompressionMethod", "Step", "build_method",
       "method_names", "parse_spec", "Decoder", "perplexity", "KVSpliceHFCache", "CoefficientHFCache",
       "SubsetHFCache", "DenseKV", "ModelAttention", "LowRank", "KVBases", "HeadBases", "TokenSelection",
       "make_selector", "TokenSelector", "OnlineFD", "OnlineDecoder", "load_model", "Plan"]


@pytest.mark.parametrize("name", API)
def test_kvsplice_exports_the_api_name(name):
    obj = getattr(kvsplice, name)
    home = importlib.import_module(kvsplice._EXPORTS[name])
    assert getattr(home, name) is obj and name in kvsplice.__all__


def test_kvsplice_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvsplice.nope  # noqa: B018
