"""Where a compressed cache's decode step spends its time, beside the full cache's → ``results/decode_profile.{json,md}``.

    python -m benchmarks.decode_profile                       # SmolLM2 shapes at 2k, one thread, + the model's step
    python -m benchmarks.decode_profile --contexts 2048 8192 --no-model
    python -m benchmarks.decode_profile --compile             # + torch.compile of the fused formulation (~30 s more)

Two views, one torch thread, medians: **one layer's attention** (SmolLM2-135M's shapes, batch 1) — SDPA over fp32
keys and values against :func:`kvsplice.core.coded.coded_attend` over a real KIVI-4 cache (group 32, residual 128)
and its parts (the pass converting the codes, the two products) at fp32 and bf16; with ``--compile`` a fused
dequantise-and-reduce formulation by ``torch.compile`` (no float copy of the codes). **One decode step of the
model** (``--model``, the Decoder door): torch.profiler's self-CPU time for the full cache and ``kivi4``, summed
into matrix products, SDPA, conversions / copies and the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.harness.options import add_model
from benchmarks.harness.paths import SMOLLM2
from benchmarks.harness.runner import Study
from benchmarks.lib.kivi_profile import D, HKV, HQ, kivi_layer, median_us, scores_fused, weighted_fused

@torch.no_grad()
def layer_rows(n: int, compile_: bool) -> list[dict]:
    """Per-layer attention times (µs) at ``n`` held tokens."""
    from kvsplice.core.coded import coded_attend, nibbles

    cache, k, v, q = kivi_layer(n)
    scale = D ** -0.5
    segs = cache.append_segments(0, k[:, :, -1:], v[:, :, -1:])  # a decode step's: the codes as stored + the window
    keys, vals = segs[0].keys, segs[0].values
    rows_q = (q.float() * scale).reshape(1, HKV, HQ // HKV, D)  # (B, Hkv, g, D)
    p = torch.softmax(keys.scores(rows_q), -1)  # (B, Hkv, g, n_q)
    calls = {"full cache: SDPA over fp32 K, V": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
             "kivi4: coded_attend (all segments, softmax)": lambda: coded_attend(q, segs, scale=scale),
             "kivi4: keys' scores (ChannelGroupKeys.scores)": lambda: keys.scores(rows_q),
             "kivi4: values' weighted sum (Rows.weighted)": lambda: vals.weighted(p)}
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x = nibbles(keys.data, dt)  # (B, Hkv, n_q, D)
        w = torch.randn(1, HKV, x.shape[2] // 32, HQ // HKV, D).to(dt)
        calls[f"  one pass over the key codes: conversion to {name}"] = lambda dt=dt: nibbles(keys.data, dt)
        calls[f"  the keys' product at {name} (per token group)"] = lambda x=x, w=w: (
            x.view(1, HKV, -1, 32, D) @ w.transpose(-1, -2))
    rows = [{"context": n, "op": name, "us": median_us(fn)} for name, fn in calls.items()]
    if compile_:  # compiled after the other timings (its warm-up compiles)
        cs = torch.compile(scores_fused, dynamic=False)
        cw = torch.compile(weighted_fused, dynamic=False)
        cs(rows_q, keys.data, keys.scale, keys.mn)
        cw(p, vals.data, vals.scale, vals.mn)
        rows += [{"context": n, "op": "kivi4 keys, fused by torch.compile",
                  "us": median_us(lambda: cs(rows_q, keys.data, keys.scale, keys.mn))},
                 {"context": n, "op": "kivi4 values, fused by torch.compile",
                  "us": median_us(lambda: cw(p, vals.data, vals.scale, vals.mn))}]
    return rows


GROUPS = (("matrix products (aten::mm / bmm / linear)", ("aten::mm", "aten::bmm", "aten::addmm")),
          ("SDPA", ("aten::_scaled_dot_product_flash_attention_for_cpu",)),
          ("conversions and copies", ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::__rshift__",
                                      "aten::contiguous")))


@torch.no_grad()
def step_rows(model, n: int, spec: str = "kivi4") -> list[dict]:
    """Self-CPU ms per decode step of ``model`` at ``n`` tokens by op group: the full cache and ``spec`` in the
    Decoder door."""
    from torch.profiler import ProfilerActivity, profile

    from kvsplice.core.build import build_method
    from benchmarks.lib.speed import prefill_and_steps

    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    out = []
    for label, method in (("full", None), (spec, build_method(spec))):
        prefill, step, _ = prefill_and_steps(model, "decoder", method, ids, n + 16)
        nxt = prefill()[:, -1:].argmax(-1)
        for _ in range(2):
            nxt = step(nxt)[:, -1:].argmax(-1)
        steps = 3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                nxt = step(nxt)[:, -1:].argmax(-1)
        tot = {g: 0.0 for g, _ in GROUPS}
        tot["everything else"] = 0.0
        for e in prof.key_averages():
            g = next((g for g, ops in GROUPS if e.key in ops), "everything else")
            tot[g] += e.self_cpu_time_total / 1e3 / steps
        out += [{"context": n, "method": label, "group": g, "ms": ms} for g, ms in tot.items()]
    return out


def options(p) -> None:
    p.add_argument("--contexts", nargs="+", type=int, help="held tokens")
    add_model(p, SMOLLM2)
    p.add_argument("--no-model", action="store_true", help="only the per-layer times")
    p.add_argument("--compile", action="store_true", help="+ the torch.compile'd fused formulation")


def rows(run):
    model = None
    if not run.args.no_model:
        from kvsplice.loading import load_model

        model = load_model(run.args.model, dtype=torch.float32).model
    for n in run["contexts"]:
        for r in layer_rows(n, run.args.compile):
            run.say(f"T={n} {r['op']}: {r['us']:.0f} µs")
            yield {"view": "layer", **r}
        if model is not None:
            yield from ({"view": "step", **r} for r in step_rows(model, n))


STUDY = Study("decode_profile", __doc__, rows, options=options, bounds={"contexts": (160, 1 << 17)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
