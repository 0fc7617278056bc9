"""KV-cache compression: compression methods behind one interface, run by two doors — the package's layer-wise
``Decoder`` and a ``transformers.Cache`` inside HF ``generate()`` — plus the shared decode caches, KVSplice, byte
accounting and post-training bases.

::

    from kvsplice import Decoder, KVSpliceHFCache, LowRank, TokenSelection, make_selector, KVBases, build_method
    method = TokenSelection(make_selector("balancekv"), 64, store=LowRank(KVBases.load("r4.safetensors"),
                                                                          cache_quant="int8"))
    method = build_method("select:balancekv@64+lowrank:r4.safetensors+int8")      # the same, by name
    Decoder(model, method).generate(ids, 32)                               # the package's decoder
    model.generate(ids, past_key_values=KVSpliceHFCache(model, method))    # transformers' generate()

Names are imported on first use (``import kvsplice`` stays light; the HF door imports transformers). The
commands are ``kvsplice VERB`` (:mod:`kvsplice.cli`, one module per verb); calibration and
fits are ``kvsplice.lowrank.calibrate`` / ``kvsplice.lowrank.fit_bases``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    # the method core and the package's door
    "CompressionMethod": "kvsplice.core.method", "Step": "kvsplice.core.method",
    # methods by name: a spec (dict or short form) -> a method; every registered name
    "build_method": "kvsplice.core.build", "build_selector": "kvsplice.core.build",
    "parse_spec": "kvsplice.core.short_form", "format_spec": "kvsplice.core.short_form",
    "method_names": "kvsplice.core.registry", "selector_names": "kvsplice.core.registry",
    "MethodSpecError": "kvsplice.core.registry",
    "Decoder": "kvsplice.decode", "DenseKV": "kvsplice.decode", "ModelAttention": "kvsplice.decode",
    "perplexity": "kvsplice.decode", "sequence_nll": "kvsplice.decode", "score_continuation": "kvsplice.decode",
    # methods
    "LowRank": "kvsplice.lowrank", "KVBases": "kvsplice.lowrank", "HeadBases": "kvsplice.lowrank",
    "BasesMismatchError": "kvsplice.lowrank",  # calibrate / fit_bases: kvsplice.lowrank (kvsplice fit-bases is the CLI)
    "TokenSelection": "kvsplice.select", "TokenSelector": "kvsplice.select", "make_selector": "kvsplice.select",
    "run_token_selection": "kvsplice.select",
    "OnlineFD": "kvsplice.online", "OnlineDecoder": "kvsplice.online",
    "KIVI": "kvsplice.quant", "SnapKVSelector": "kvsplice.select", "ObservedAttentionSelector": "kvsplice.select",
    "RotatedKIVI": "kvsplice.quant", "PreRopeKIVI": "kvsplice.quant", "KVzipSelection": "kvsplice.select",
    "ExpectedAttentionSelector": "kvsplice.select",
    "JointLowRank": "kvsplice.lowrank.joint", "JointBases": "kvsplice.lowrank.joint",
    "allocate_ranks": "kvsplice.lowrank.allocate", "calibrate_all": "kvsplice.lowrank.sensitivity",
    # the loader every command uses: a model folder, GGUF, checkpoint or family name -> a loaded model
    "load_model": "kvsplice.loading",
    # the budget planner's plans (kvsplice plan writes them)
    "Plan": "kvsplice.planning",
    # long-context tasks (kvsplice eval-tasks)
    "make_instance": "kvsplice.tasks.suite", "TASKS": "kvsplice.tasks.suite", "answer": "kvsplice.tasks.runner",
    "answer_many": "kvsplice.tasks.shared", "parse_method": "kvsplice.tasks.methods",
    # the HF door
    "KVSpliceHFCache": "kvsplice.hf", "CoefficientHFCache": "kvsplice.hf", "SubsetHFCache": "kvsplice.hf",
    # the trained models (models/): the model, its one typed config and presets, CUDA-graph decode, the decode kernel
    "GPT": "models", "GPTConfig": "models", "preset": "models", "GraphDecoder": "models.graph_decode",
    "decode_attend": "models.kernels",
    # caches and KVSplice
    "Cache": "models.cache", "DecodeCache": "models.stream_cache", "KVCache": "models.stream_cache",
    "LatentCache": "models.stream_cache", "CompressedLatentCache": "models.stream_cache",
    "CoefficientCache": "kvsplice.lowrank", "SubsetCache": "kvsplice.select",
    "ChunkedCache": "kvsplice.online", "LearnedKVSplice": "models.splice",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsplice' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
