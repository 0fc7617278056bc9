"""A compression method defined in this file alone — K/V rounded to fp16 — is reachable by its name everywhere:
``eval_bases --method``, ``generate --method``, the planner's candidate stores (``plan --stores``), the package's
``Decoder`` and ``KVSpliceHFCache`` inside ``transformers.generate()``, with measured bytes == its ``bytes_formula``
(on stories260K, a real GQA + RoPE Llama)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvsplice.cli import eval_bases, generate, plan as plan_cli
from kvsplice.core.method import CompressionMethod, layer_tokens
from kvsplice.core.build import build_method
from kvsplice.core.registry import method_names
from models.stream_cache import KVCache

from benchmarks.harness.paths import CALIB as TEXT, DATA, EVAL, STORIES

pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file() or not TEXT.is_file(),
                                reason=f"stories260K / TinyStories not found under {DATA}")
NAME = "test-fp16-kv"


class Fp16KV(CompressionMethod):
    """Keys and values rounded to fp16 (held at the cache dtype); a storage method."""

    name = NAME
    cache_type = KVCache
    is_storage = True

    def __init__(self, round_values: bool = True) -> None:
        self.round_values = round_values

    def new_cache(self, batch_size, capacity=None, *, dtype, device):
        a = self._bound()
        return KVCache(a.n_layer, a.n_kv_head, a.head_dim, batch_size, dtype=dtype, device=device, capacity=capacity)

    def bytes_formula(self, batch_size, n_held, dtype):
        a = self._bound()
        return 2 * a.n_kv_head * a.head_dim * layer_tokens(n_held, a.n_layer) * batch_size * \
            torch.empty((), dtype=dtype).element_size()

    def _round(self, k, v, dtype):
        k = k.half().to(dtype)
        return k, (v.half() if self.round_values else v).to(dtype)

    def append(self, layer, k, v, cache, step):
        k, v = self._round(k, v, cache.dtype)
        cache.append(layer, k=k, v=v)

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        k, v = self._round(k, v, cache.dtype)
        kv = cache.append(layer, k=k, v=v)  # (B, Hkv, Tk, D) each
        return step.attend(layer, q, kv["k"].to(q.dtype), kv["v"].to(q.dtype), mask=mask, logw=logw)


@pytest.fixture(scope="module")
def s260k(tmp_path_factory) -> Path:
    from kvsplice.convert.llama2c import convert_llama2c

    return convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("s260k"))


def test_the_toy_method_is_registered_and_rebuilds_from_its_spec():
    assert NAME in method_names()
    m = build_method(f"{NAME}(round_values=false)")
    assert isinstance(m, Fp16KV) and m.round_values is False and m.spec() == {"name": NAME, "round_values": False}
    assert build_method(m.spec()).spec() == m.spec()


def test_both_doors_run_it_by_name_with_measured_bytes_equal_to_the_formula(s260k):
    from kvsplice.decode import Decoder
    from kvsplice.hf import KVSpliceHFCache
    from kvsplice.loading import load_model
    from kvsplice.report.memory import measure_cache

    model = load_model(str(s260k)).model
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    for spec, held in ((NAME, 24 + 6 - 1), (f"select:snapkv@8+{NAME}", 8 + 6 - 1)):
        dec = Decoder(model, spec)  # the doors take a spec as well as a method
        out = dec.generate(ids, max_new_tokens=6)
        cache = KVSpliceHFCache(model, spec)
        with torch.no_grad():
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=6,
                                do_sample=False)
        assert torch.equal(out, hf), spec
        assert cache.seq_len == held
        assert measure_cache(cache).live_bytes == cache.nbytes() == cache.formula_nbytes() == \
            cache.method.bytes_formula(2, held, torch.float32), spec
        c = dec.new_cache(2)
        dec(ids, c)
        assert measure_cache(c).live_bytes == c.nbytes() == dec.method.bytes_formula(2, c.seq_len, c.dtype)
    # fp16 rounding of tiny-model K/V changes the logits only slightly
    with torch.no_grad():
        want = model(ids).logits
    got = Decoder(model, build_method(NAME))(ids, Decoder(model, build_method(NAME)).new_cache(2))
    assert (got - want).abs().max() < 1e-2


def test_eval_bases_generate_and_the_planner_take_it_by_name(s260k, tmp_path, capsys):
    rep = tmp_path / "e.json"
    assert eval_bases.main(["--model", str(s260k), "--method", NAME, "--data", str(EVAL), "--tokens", "512",
                            "--seq-len", "128", "--no-progress", "--json", str(rep)]) == 0
    r = json.loads(rep.read_text())["results"][0]
    assert r["spec"] == {"name": NAME} and all(m["formula_match"] for m in r["measured"])
    assert abs(r["ppl_ratio"] - 1) < 1e-2  # fp16 rounding is nearly lossless

    g = tmp_path / "g.json"
    assert generate.main(["--model", str(s260k), "--method", f"select:snapkv@0.5+{NAME}", "--prompt",
                          "Once upon a time there was a little girl", "--max-new-tokens", "5", "--json", str(g)]) == 0
    doc = json.loads(g.read_text())
    assert doc["cache_bytes"] == doc["cache_bytes_formula"] and doc["spec"]["store"] == {"name": NAME}

    out, rep = tmp_path / "plan.json", tmp_path / "report.json"
    assert plan_cli.main(["--model", str(s260k), "--calib", str(TEXT), "--calib-tokens", "512", "--tune-tokens",
                          "512", "--seq-len", "128", "--tune-length", "300", "--no-progress", "--ratio", "2",
                          "--stores", "int8", NAME, "--selectors", "snapkv", "--out", str(out), "--json",
                          str(rep)]) == 0  # the tuning tasks need up to ~240 tokens
    cands = json.loads(rep.read_text())["candidates"]
    assert any(c["spec"].get("store") == {"name": NAME} for c in cands)  # 2x: the toy under a selection
    from kvsplice.planning import Plan

    plan = Plan.load(out)
    assert plan.method(prompt_len=96).bytes_formula is not None
    capsys.readouterr()
    assert plan_cli.main(["--model", str(s260k), "--calib", str(TEXT), "--calib-tokens", "512", "--tune-tokens",
                          "512", "--seq-len", "128", "--no-progress", "--ratio", "2", "--stores", "nosuch",
                          "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown method 'nosuch'" in err[0] and NAME in err[0]
