"""Constructor arguments of every selector and storage method (:mod:`kvsplice.core.args`): a wrong type, a value out
of range or past a sane bound is one ``ValueError`` line naming the argument — from Python, a plan file or a CLI
alike (BalanceKV with ``n_halvings=1000000`` never returned; ``n_sink=-100`` / ``2.5`` and ``seed="abc"``
were tracebacks deep in a selection)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from kvsplice.decode import DenseKV
from kvsplice.lowrank.method import LowRank
from kvsplice.quant.method import KIVI
from kvsplice.quant.rotated import RotatedKIVI
from kvsplice.select.kvzip import KVzipSelection
from kvsplice.select.selectors import SELECTORS, make_selector
from tiny_models import orthonormal_bases

BAD = {  # selector -> [(arguments, words of the error)]
    "balancekv": [({"n_halvings": 1_000_000}, "n_halvings must be in [1, 40]"), ({"n_halvings": 0}, "n_halvings"),
                  ({"block_size": 3}, "block_size must be an even number"), ({"c_scale": float("nan")}, "c_scale"),
                  ({"c_scale": -1.0}, "c_scale must be > 0"), ({"kernel_temp": float("inf")}, "kernel_temp"),
                  ({"center": "yes"}, "center must be true or false"), ({"n_recent": 2 ** 40}, "n_recent")],
    "streaming_llm": [({"n_sink": -100}, "n_sink must be in [0,"), ({"n_sink": 2.5}, "n_sink must be an integer")],
    "uniform": [({"n_recent": True}, "n_recent must be an integer"), ({"seed": "abc"}, "seed must be an integer")],
    "knorm": [({"n_sink": -1}, "n_sink"), ({"seed": -3}, "seed must be in [0,")],
    "snapkv": [({"window": 0}, "window must be in [1,"), ({"kernel": 4}, "kernel must be an odd number"),
               ({"windw": 8}, "selector snapkv takes window, kernel, seed")],
    "observed_attention": [({"normalize": 1}, "normalize must be true or false"), ({"chunk": 0}, "chunk")],
    "expected_attention": [({"window": 1}, "window must be in [2,"), ({"window": 2.5}, "window must be an integer"),
                           ({"n_sink": -1}, "n_sink must be in [0,"), ({"cov": 1}, "cov must be true or false"),
                           ({"seed": "abc"}, "seed must be an integer")],
}


def test_every_selector_has_hostile_cases():
    """Every selector the package ships (not those other test files register) has hostile cases here."""
    shipped = {name for name, cls in SELECTORS.items() if cls.__module__.startswith("kvsplice.")}
    assert set(BAD) == shipped


@pytest.mark.parametrize("name,kw,words", [(n, kw, w) for n, cases in sorted(BAD.items()) for kw, w in cases])
def test_bad_selector_arguments_are_one_line(name, kw, words):
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        make_selector(name, **kw)
    assert "\n" not in str(e.value)


def test_the_largest_halving_count_still_selects_at_once():
    """The bound is no tuning choice: at ``n_halvings=40`` a selection still runs (on real keys, 48 tokens)."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 48, 8, generator=g), torch.randn(2, 48, 8, generator=g)
    sel = make_selector("balancekv", n_sink=2, n_recent=4, block_size=8, n_halvings=40, c_scale=math.inf)
    idx, logw = sel.select(k, v, 20)
    assert idx.shape == logw.shape == (2, 20) and bool((idx.diff(dim=1) > 0).all())


@pytest.mark.parametrize("build,words", [
    (lambda: KIVI(bits=3), "bits must be one of 2, 4, 8"), (lambda: KIVI(bits=True), "bits"),
    (lambda: KIVI(group=2.5), "group must be an integer"), (lambda: KIVI(residual=-1), "residual must be in [0,"),
    (lambda: DenseKV(cache_quant="int2"), "cache_quant must be one of None, 'int8', 'int4'"),
    (lambda: LowRank(orthonormal_bases(1, 1, 4, 2, "post"), cache_quant="fp8"), "cache_quant"),
    (lambda: RotatedKIVI(bits=3), "bits must be one of 2, 4, 8"), (lambda: RotatedKIVI(residual=-1), "residual"),
    (lambda: KVzipSelection(4, chunk=0), "chunk must be in [1,")])
def test_bad_storage_arguments_are_one_line(build, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        build()
