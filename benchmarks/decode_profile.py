"""Where a compressed cache's decode step spends its time, beside the full cache's → ``results/decode_profile.*``.

    python -m benchmarks.decode_profile                       # SmolLM2 shapes at 2k, one thread, + the model's step
    python -m benchmarks.decode_profile --contexts 2048 8192 --no-model
    python -m benchmarks.decode_profile --compile             # + torch.compile of the fused formulation (~30 s more)

Two views, one torch thread: one layer's attention (SmolLM2-135M's shapes), SDPA over fp32 K, V against
:func:`kvsplice.core.coded.coded_attend` over a KIVI-4 cache and its parts; one decode step's self-CPU ms by op group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.harness import studies
from benchmarks.harness.options import add_model
from benchmarks.harness.paths import SMOLLM2
from benchmarks.harness.runner import Study
from benchmarks.harness.timing import median_of, wall_time
from models.quant import unpack_codes

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M's attention
GROUPS: dict = studies.load("decode_profile")["groups"]  # the step view's op groups: name -> its ops


def kivi_layer(n: int, seed: int = 0):
    """A one-layer KIVI-4 cache (group 32, residual 128) holding ``n`` random post-RoPE tokens, its keys and values,
    and a decode query ``(1, Hq, 1, D)``."""
    from kvsplice.quant.cache import KIVICache

    g = torch.Generator().manual_seed(seed)
    cache = KIVICache(1, HKV, D, 1, bits=4, group=32, residual=128, capacity=n + 8)
    k, v = torch.randn(1, HKV, n, D, generator=g), torch.randn(1, HKV, n, D, generator=g)
    cache.append(0, k, v)
    return cache, k, v, torch.randn(1, HQ, 1, D, generator=g)


def scores_fused(qs, codes, s, m):
    """KIVI keys dequantised and reduced in one expression (what torch.compile fuses: no float copy of the codes):
    ``qs (B, Hkv, g, D)``, packed ``codes (B, Hkv, n, D/2)``, per-channel ``s, m (B, Hkv, n/G, D)`` →
    ``(B, Hkv, g, n)``."""
    b, h, r, d = qs.shape
    x = unpack_codes(codes, 4).float()  # (B, Hkv, n, D)
    x = x.view(b, h, s.shape[2], -1, d) * s.float()[:, :, :, None] + m.float()[:, :, :, None]  # (B,Hkv,n/G,G,D)
    return (qs[:, :, :, None, :] * x.view(b, h, 1, -1, d)).sum(-1)


def weighted_fused(p, codes, s, m):
    """KIVI values, the same way: ``p (B, Hkv, g, n)``, packed ``codes (B, Hkv, n, D/2)``, per-token
    ``s, m (B, Hkv, n, D/G)`` → ``(B, Hkv, g, D)``."""
    x = unpack_codes(codes, 4).float()  # (B, Hkv, n, D)
    b, h, n, d = x.shape
    x = (x.view(b, h, n, s.shape[-1], -1) * s.float()[..., None] + m.float()[..., None]).view(b, h, 1, n, d)
    return (p[..., None] * x).sum(-2)


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
    rows = [{"context": n, "op": name, "us": 1e6 * median_of(wall_time, fn, 40, 5)} for name, fn in calls.items()]
    if compile_:  # compiled after the other timings (its warm-up compiles)
        fused = {"keys": (scores_fused, (rows_q, keys.data, keys.scale, keys.mn)),
                 "values": (weighted_fused, (p, vals.data, vals.scale, vals.mn))}
        for name, (fn, args) in fused.items():
            c = torch.compile(fn, dynamic=False)  # compiled by the first warm-up call
            us = 1e6 * median_of(wall_time, lambda: c(*args), 40, 5)
            rows.append({"context": n, "op": f"kivi4 {name}, fused by torch.compile", "us": us})
    return rows


@torch.no_grad()
def step_rows(model, n: int, spec: str = "kivi4") -> list[dict]:
    """Self-CPU ms per decode step of ``model`` at ``n`` tokens by op group: the full cache and ``spec`` (Decoder)."""
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
        tot = dict.fromkeys([*GROUPS, "everything else"], 0.0)
        for e in prof.key_averages():
            g = next((g for g, ops in GROUPS.items() if e.key in ops), "everything else")
            tot[g] += e.self_cpu_time_total / 1e3 / steps
        out += [{"context": n, "method": label, "group": g, "ms": ms} for g, ms in tot.items()]
    return out


def options(p) -> None:
    p.add_argument("--contexts", nargs="+", type=int, help="held tokens")
    add_model(p, SMOLLM2)
    p.add_argument("--no-model", action="store_true", help="only the per-layer times")
    p.add_argument("--compile", action="store_true", help="+ the torch.compile'd fused formulation")


def rows(run):
    from kvsplice.loading import load_model

    model = None if run.args.no_model else load_model(run.args.model, dtype=torch.float32).model
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
