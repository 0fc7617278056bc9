""":class:`Bench` measures a row of ``benchmarks/smollm2_frontier.py`` on SmolLM2-135M-Instruct (its windows and
calibration statistics): every method family and stack, the planner's picks, transformers' own quantized caches."""

from __future__ import annotations

import math
import time

import torch
from transformers.cache_utils import QuantizedCache

import benchmarks.lib.smollm2_windows as C
from benchmarks.lib.doors import hf_nll
from kvsplice import build_method
from kvsplice.adapters import adapter_for
from kvsplice.evaluation.protocol import evaluate, full_bytes_per_token
from kvsplice.hf.measure import cache_nbytes
from kvsplice.lowrank.fits import fit_bases
from kvsplice.lowrank.joint import JointLowRank, allocate_joint
from kvsplice.planning.search import SearchOptions, lowrank_bases, search, selection
from kvsplice.planning.spec import spec_label

PROMPT = 768


def _ranks(r: dict, heads: int = 1) -> dict:
    """Mean key / value ranks of ``ranks()`` (per layer and head, or per layer over ``heads`` KV heads) and them."""
    flat = {s: [x for row in r[s] for x in (row if isinstance(row, list) else [row])] for s in "kv"}
    return {**{f"mean_{s}": sum(f) / len(f) / heads for s, f in flat.items()}, "k": r["k"], "v": r["v"]}


class Bench:
    def __init__(self, threads: int) -> None:
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        self.loaded = C.load()
        self.model = self.loaded.model
        self.eval = C.eval_windows(self.loaded)  # (4, 1024)
        self.tune = C.token_windows(self.loaded, C.CALIB, 2 * C.SEQ, skip=C.CALIB_TOKENS)  # (2, 1024): tuning slice
        self.s_windows = C.token_windows(self.loaded, C.VAL, 5 * 832, seq=832)  # (5, 832)
        print(f"loaded in {time.perf_counter() - t0:.0f} s; eval {tuple(self.eval.shape)}, tune "
              f"{tuple(self.tune.shape)}, S {tuple(self.s_windows.shape)}", flush=True)
        self.stats = C.stats(self.loaded)[0]
        self.bases: dict = {}

    def lowrank_bases(self, spec: dict):
        """Fisher bases allocated ``×alloc`` smaller (the planner's), or ``method``'s bases at one ``rank``."""
        rope = spec.get("rope", "pre")
        if "alloc" in spec:
            return lowrank_bases(self.stats, spec["alloc"], rope, self.bases)
        key = (spec["method"], rope, spec["rank"])
        if key not in self.bases:
            self.bases[key] = fit_bases(self.stats[rope], spec["method"], rank=spec["rank"])
        return self.bases[key]

    def method_spec(self, spec: dict) -> dict:
        """The method spec (:func:`kvsplice.build_method`) of a row's ``spec``: its store (dense / int8 / kivi /
        lowrank with the row's bases), under its selector keeping ``1/x`` of the prompt."""
        store = spec.get("store", "dense")
        if store == "kivi":
            ms = {"name": "kivi", "bits": spec.get("bits", 4), "residual": spec.get("residual", 128)}
        elif store == "lowrank":
            ms = {"name": "lowrank", "bases": self.lowrank_bases(spec), "cache_quant": spec.get("cache_quant")}
        else:
            ms = {"name": "dense", "cache_quant": "int8"} if store == "int8" else {"name": "dense"}
        x = spec.get("x")
        return ms if spec.get("selector") is None else selection(ms, spec["selector"], 1.0 if x is None else 1 / x)

    def plan(self, ratio: float) -> tuple[dict, dict]:
        """The frontier's plan at ``ratio``: the perplexity objective over the attention selectors (what results/
        holds; the planner's default since then is measured by smollm2_tasks.py)."""
        opts = SearchOptions(prompt_len=PROMPT, budget=full_bytes_per_token(adapter_for(self.model)) / ratio,
                             batch_size=2, objective="ppl", prefill="any", selectors=("snapkv", "observed_attention"))
        found = search(self.model, self.stats, self.tune, opts, log=lambda s: print(s, flush=True))
        return found["best"], {"candidates": found["candidates"], "selector": found["selector"],
                                "tuning_full_ppl": found["full"]["tuning_ppl"]}

    def hf_quantized(self, rid: str, spec: dict) -> dict:
        """transformers' ``QuantizedCache`` (its defaults: group 64, residual 128, axis 0) on protocol P, token by
        token; bytes measured from the cache's tensors (quanto's packed data, scales, shifts) after the prefill."""
        t0, held = time.perf_counter(), []
        kw = {} if spec["hf_quant"] == "fp8" else {"nbits": spec["nbits"]}  # fp8: per tensor, no nbits
        cache = QuantizedCache(spec["hf_quant"], config=self.model.config, **kw)
        nll = hf_nll(self.model, cache, self.eval, PROMPT, decode_chunk=1,
                     after_prefill=lambda: held.append(cache_nbytes(cache)))
        bpt = held[0] / (self.eval.shape[0] * PROMPT)
        return {"id": rid, "protocol": "P", "spec": spec, "ppl": math.exp(nll), "bytes_per_token": bpt,
                "ratio_vs_fp16_full": 23040 / bpt, "seconds": time.perf_counter() - t0,
                "label": f"transformers QuantizedCache({spec['hf_quant']}, {spec['nbits']}-bit; measured, fp32 "
                         f"scales)", "note": "bytes measured from the cache's tensors after the prefill; its scales "
                                             "and any full-precision states are at the model's fp32"}

    def run(self, rid: str, proto: str, spec: dict) -> dict:
        if "hf_quant" in spec:
            return self.hf_quantized(rid, spec)
        windows = self.s_windows if proto == "S" else self.eval
        prompt, extra = 0 if proto == "W" else PROMPT, {}
        if spec.get("store") == "joint":  # grouped-head joint latents: a method of its own, not a planner store
            s = self.stats[spec.get("rope", "pre")]
            n = round(2 * s.n_layer * s.n_kv_head * s.head_dim / spec["alloc"])
            jb = allocate_joint(s, n, spec.get("method", "fisher"))
            method = JointLowRank(jb)
            ranks = {**_ranks(jb.ranks(), s.n_kv_head), "note": "per layer, all KV heads jointly; mean_k/v per KV head"}
        else:
            ms, extra = self.plan(spec["plan"]) if "plan" in spec else (self.method_spec(spec) if spec else None, {})
            method = None if ms is None else build_method(ms, prompt_len=prompt or windows.shape[1])
            label = "full K/V" if ms is None else spec_label(ms)
            ranks = _ranks(ms["bases"].ranks()) if spec.get("store") == "lowrank" else None
        if spec.get("store") in ("lowrank", "joint"):
            what = f"r{spec['rank']}" if "rank" in spec else f"allocated ×{spec['alloc']:g}"
            label = f"{spec['store']} {spec.get('method', 'fisher')} {spec.get('rope', 'pre')}-RoPE {what}" + \
                ("+int8" if spec.get("cache_quant") else "")
        res = evaluate(self.model, method, windows, prompt_len=prompt, batch_size=windows.shape[0])
        res.update({"id": rid, "protocol": proto, "spec": spec, "label": label, **extra})
        return res if ranks is None else {**res, "ranks": ranks}
