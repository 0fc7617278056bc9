"""The serving measurements, shared by ``benchmarks/serving.py`` and ``benchmarks/gpu_check.py``'s sections: models
at the 124M presets (random weights), a cache's bytes per sequence, a filled cache, one decode step's median ms
(eager or replayed from a CUDA graph, rolled back after each), the capacity rows at a memory budget (compared with
MHA's) and the attention call alone (SDPA against the split-KV kernel, :mod:`models.kernels`)."""

from __future__ import annotations

import gc
import statistics
from typing import Callable, Optional

import torch

from benchmarks.harness.timing import cuda_time, wall_time
from models import GPT, preset
from models.attention import attend
from models.quant import SCALE, quantize_int8
from models.kernels import decode_attend, interpreting, triton_missing_reason

VARIANTS = {"MHA": "gpt2", "GQA-4": "gpt2_gqa4", "MQA": "gpt2_mqa", "MLA": "mla", "KVSplice-50": "mla_kvsplice_50",
            "KVSplice-90": "mla_kvsplice_90"}
SMOKE_SHAPES = dict(n_layer=2, n_head=4, d_model=64, d_latent=32)
CLAIM = ("KVSplice 90 %: ~11,700 parallel sequences in 24 GB at 1,024 tokens, 18x throughput (the seed's claim, "
         "against MHA)")
RESERVE_BYTES = 4 * 2**30
"""GPU memory kept free beside the caches and weights (activations, logits, the CUDA graph's pool)."""


# ------------------------------------------------------------------------------------------------- timing
def timer(device: torch.device) -> Callable[[Callable[[], object], int], list[float]]:
    """``time(fn, n)``: ms of each of ``n`` calls (CUDA events on an idle GPU; wall clock on CPU)."""
    if device.type == "cuda":
        return cuda_time
    return lambda fn, n: [1e3 * s for s in wall_time(fn, n)]


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (read + written), median of 10."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    ms = statistics.median(timer(device)(lambda: y.copy_(x), 10))
    return 2 * x.numel() * 2 / (ms / 1e3)


def kernel_runs_here(device: torch.device) -> Optional[str]:
    """Why the split-KV kernel cannot run on ``device`` here, or None."""
    reason = triton_missing_reason()
    if reason is None and device.type != "cuda" and not interpreting():
        reason = "CPU without Triton's interpreter (TRITON_INTERPRET=1)"
    return reason


# ----------------------------------------------------------------------------------------------- capacity
def build(name: str, kernel: str, ctx: int, smoke: bool, device: torch.device, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    cfg = preset(VARIANTS[name], block_size=ctx + 2, decode_kernel=kernel, **(SMOKE_SHAPES if smoke else {}))
    return GPT(cfg).to(device, dtype).eval()


def seq_bytes(model: GPT, ctx: int, quant: Optional[str]) -> int:
    """Bytes of one sequence's cache holding ``ctx + 1`` tokens (allocated on the meta device: nothing real)."""
    p = next(model.parameters())
    return model.new_cache(1, capacity=ctx + 1, quant=quant, dtype=p.dtype, device="meta").storage_nbytes()


def filled_cache(model: GPT, batch: int, ctx: int, quant: Optional[str]):
    """A cache of ``batch`` sequences holding ``ctx`` random tokens (int8 rows: random values, scales ~0.01)."""
    cache = model.new_cache(batch, capacity=ctx + 1, quant=quant)
    for layer in range(cache.n_layer):
        for name, buf in cache.storage(layer).items():
            if buf.dtype == torch.int8:
                buf.random_(-127, 128)
            elif name.endswith(SCALE):
                buf.fill_(0.01)
            else:
                buf.normal_()
        cache.reserve(layer, ctx, written=True)
    return cache


def decode_step_ms(model: GPT, batch: int, ctx: int, quant: Optional[str], steps: int, graph: bool,
                   warmup: int = 2) -> float:
    """Median ms of one decode step at ``ctx`` tokens (rolled back after each), from a CUDA graph if ``graph``."""
    cache = filled_cache(model, batch, ctx, quant)
    tok = torch.randint(0, model.cfg.vocab_size, (batch, 1), device=cache.device)
    if graph:
        from models.graph_decode import GraphDecoder

        dec = GraphDecoder(model, cache)
        fn = lambda: dec.step(tok)  # noqa: E731
    else:
        fn = lambda: model(tok, cache=cache)  # noqa: E731

    def one():
        with torch.inference_mode():
            fn()
        cache.truncate(ctx)

    for _ in range(warmup):
        one()
    return statistics.median(timer(cache.device)(one, steps))


def bench_capacity(args, device, dtype, bandwidth: float, progress) -> list[dict]:
    kernels = ["eager"] + (["triton"] if kernel_runs_here(device) is None else [])
    rows = []
    for name in progress(args.variants, "capacity"):
        models = {k: build(name, k, max(args.ctx), args.smoke, device, dtype) for k in kernels}  # same weights
        m = models["eager"]
        for ctx in args.ctx:
            for quant in (None, "int8"):
                per_seq = seq_bytes(m, ctx, quant)
                weights = sum(p.numel() * p.element_size() for p in m.parameters())
                budget = args.budget_gb * 1e9
                if device.type == "cuda":  # the models are loaded already: free memory excludes their weights
                    budget = min(budget, torch.cuda.mem_get_info()[0] - RESERVE_BYTES)
                fits = max(int(budget // per_seq), 0)
                row = dict(variant=name, rows="int8" if quant else str(dtype).split(".")[-1], ctx=ctx,
                           bytes_per_seq=per_seq, budget_gb=args.budget_gb, max_batch=fits,
                           batch=min(fits, args.max_batch), weight_bytes=weights)
                step_bytes = row["batch"] * per_seq + weights
                row["bytes_per_step"] = step_bytes
                row["floor_ms"] = step_bytes / bandwidth * 1e3
                for k, model in models.items():
                    label = "sdpa" if k == "eager" else "split_kv"
                    if row["batch"] < 1:
                        row[f"{label}_error"] = "no sequence fits the budget"
                        continue
                    try:
                        ms = decode_step_ms(model, row["batch"], ctx, quant, args.steps, device.type == "cuda",
                                            warmup=1 if args.smoke else 2)
                        row.update({f"{label}_ms": ms, f"{label}_tokens_per_s": row["batch"] / (ms / 1e3),
                                    f"{label}_pct_floor": 100 * row["floor_ms"] / ms})
                    except torch.cuda.OutOfMemoryError:
                        row[f"{label}_error"] = "out of memory"
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
        del models, m
    return compare_to_mha(rows)


def compare_to_mha(rows: list[dict]) -> list[dict]:
    """Adds to each capacity row its throughput and batch against MHA's row at the same context and row format (None
    where MHA is not among ``rows``); returns ``rows``."""
    mha = {(r["ctx"], r["rows"]): r for r in rows if r["variant"] == "MHA"}
    for r in rows:
        base = mha.get((r["ctx"], r["rows"]))
        for label in ("sdpa", "split_kv"):
            tps, ref = r.get(f"{label}_tokens_per_s"), base and base.get("sdpa_tokens_per_s")
            r[f"{label}_vs_mha_sdpa"] = tps / ref if tps and ref else None
        r["batch_vs_mha"] = r["max_batch"] / base["max_batch"] if base and base["max_batch"] else None
    return rows


# ------------------------------------------------------------------------------------------------- kernel
def kernel_cases(smoke: bool) -> list[tuple[str, int, int, int, bool]]:
    """(label, Hq, Hkv, row dims, int8): latents under 12 heads, MHA and GQA-4 rows of 64, int8 latents."""
    if smoke:
        return [("latent 26", 12, 1, 26, False), ("latent 26 int8", 12, 1, 26, True), ("MHA rows 4x16", 4, 4, 16, False)]
    lat = [(f"latent {d}", 12, 1, d, False) for d in (26, 77, 128, 256)]
    lat += [(f"latent {d} int8", 12, 1, d, True) for d in (26, 128)]
    return lat + [("MHA rows 12x64", 12, 12, 64, False), ("GQA-4 rows 4x64", 12, 4, 64, False)]


def bench_kernel(args, device, dtype, bandwidth: float, progress,
                 cases: Optional[list[tuple[str, int, int, int, bool]]] = None) -> list[dict]:
    """One row per case of ``cases`` (default :func:`kernel_cases`)."""
    batch, keys = (2, 100) if args.smoke else (64, 16384)
    run_kernel = kernel_runs_here(device) is None
    time_it = timer(device)
    rows = []
    for label, hq, hkv, d, int8 in progress(kernel_cases(args.smoke) if cases is None else cases, "kernel"):
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(batch, hq, 1, d, device=device, dtype=dtype, generator=g)
        k = torch.randn(batch, hkv, keys, d, device=device, dtype=dtype, generator=g)
        shared = hkv == 1  # a latent is key and value: read once
        v = k if shared else torch.randn_like(k)
        kq, ks = quantize_int8(k) if int8 else (k, None)
        vq, vs = (kq, ks) if shared else quantize_int8(v) if int8 else (v, None)
        el = 1 if int8 else k.element_size()
        row_bytes = batch * hkv * keys * (d * el + (2 if int8 else 0)) * (1 if shared else 2)
        row = dict(case=label, batch=batch, keys=keys, bytes_read=row_bytes)
        kf = kq.to(dtype) * ks.to(dtype) if int8 else k  # the eager path attends over dequantised rows
        vf = kf if shared else (vq.to(dtype) * vs.to(dtype) if int8 else v)
        calls = {"sdpa": lambda: attend(q, kf, vf, scale=d ** -0.5)}
        if run_kernel:
            for n in [None, *args.kernel_splits]:  # None: the kernel's own choice (choose_splits)
                calls["split_kv" if n is None else f"split_kv_s{n}"] = (
                    lambda n=n: decode_attend(q, kq, vq, scale=d ** -0.5, k_scale=ks, v_scale=vs, num_splits=n))
        outs = {}
        for name, fn in calls.items():
            outs[name] = fn()
            ms = statistics.median(time_it(fn, args.steps))
            row.update({f"{name}_ms": ms, f"{name}_gbs": row_bytes / (ms / 1e3) / 1e9,
                        f"{name}_pct_bandwidth": 100 * row_bytes / (ms / 1e3) / bandwidth})
        if "split_kv" in outs:  # a sanity check of the run: the kernel against the eager path, same rows
            row["max_abs_diff"] = (outs["split_kv"].float() - outs["sdpa"].float()).abs().max().item()
        rows.append(row)
        del q, k, v, kq, vq, kf, vf
    return rows


