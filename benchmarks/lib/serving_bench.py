"""The sections of ``benchmarks/serving.py``, each a generator of rows (124M presets, random weights): capacity at a
KV budget with its floors, the attention call alone (SDPA against :mod:`models.kernels`' split-KV kernel; latent
attention's formulations), the CUDA-graph decode step, a profiled step. A failed case is a row with its error."""

from __future__ import annotations

import gc
import itertools
import statistics
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.harness.timing import cuda_time, median_of, wall_time
from kvsplice.report.decode_timing import time_steps
from models import GPT, preset
from models.attention import attend
from models.kernels import decode_attend, interpreting, triton_missing_reason
from models.quant import SCALE, quantize_int8

VARIANTS = {"MHA": "gpt2", "GQA-4": "gpt2_gqa4", "MQA": "gpt2_mqa", "MLA": "mla", "KVSplice-50": "mla_kvsplice_50",
            "KVSplice-90": "mla_kvsplice_90"}
SMOKE_SHAPES = dict(n_layer=2, n_head=4, d_model=64, d_latent=32)
CLAIM = "KVSplice 90 %: ~11,700 parallel sequences in 24 GB at 1,024 tokens, 18x throughput (the seed's claim, vs MHA)"
RESERVE_BYTES = 4 * 2**30
"""GPU memory kept free beside the caches and weights (activations, logits, the CUDA graph's pool)."""


def err(e: BaseException) -> str:
    """A failed case's error in one line (its first line, at most 200 characters)."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "out of memory"
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timer(device: torch.device) -> Callable[[Callable[[], object], int], list[float]]:
    """``time(fn, n)``: ms of each of ``n`` calls (CUDA events on an idle GPU; wall clock on CPU)."""
    return cuda_time if device.type == "cuda" else lambda fn, n: [1e3 * s for s in wall_time(fn, n)]


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (read + written), median of 10."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / median_of(timer(device), lambda: y.copy_(x), 10, warmup=1) * 1e3


def kernel_runs_here(device: torch.device) -> Optional[str]:
    """Why the split-KV kernel cannot run on ``device`` here, or None."""
    cpu = device.type != "cuda" and not interpreting()
    return triton_missing_reason() or ("CPU without Triton's interpreter (TRITON_INTERPRET=1)" if cpu else None)


def build(name: str, kernel: str, ctx: int, smoke: bool, device: torch.device, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    cfg = preset(VARIANTS[name], block_size=ctx + 2, decode_kernel=kernel, **(SMOKE_SHAPES if smoke else {}))
    return GPT(cfg).to(device, dtype).eval()


def seq_bytes(model: GPT, ctx: int, quant: Optional[str]) -> int:
    """Bytes of one sequence's cache holding ``ctx + 1`` tokens (allocated on the meta device: nothing real)."""
    p = next(model.parameters())
    return model.new_cache(1, capacity=ctx + 1, quant=quant, dtype=p.dtype, device="meta").storage_nbytes()


def fits(budget_gb: float, per_seq: int, device: torch.device) -> int:
    """Sequences of ``per_seq`` bytes within ``budget_gb`` (on a GPU also within the free memory less a reserve)."""
    budget = budget_gb * 1e9
    if device.type == "cuda":
        budget = min(budget, torch.cuda.mem_get_info()[0] - RESERVE_BYTES)
    return max(int(budget // per_seq), 0)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


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


def time_into(row: dict, prefix: str, model: GPT, ctx: int, quant: Optional[str], steps: int, smoke: bool) -> None:
    """``prefix`` + ``ms``, ``tokens_per_s``, ``pct_floor`` (of ``row["floor_ms"]``), or ``error``, into ``row``:
    the median decode step at ``row["batch"]`` over a :func:`filled_cache` of ``ctx`` tokens (:func:`time_steps`)."""
    device = next(model.parameters()).device
    try:
        cache = filled_cache(model, row["batch"], ctx, quant)
        tok = torch.randint(0, model.cfg.vocab_size, (row["batch"], 1), device=cache.device)
        times = time_steps(model, cache, ctx, tok, 1 if smoke else 2, steps, graph=device.type == "cuda")
        ms = 1e3 * statistics.median(times)
        row.update({f"{prefix}ms": ms, f"{prefix}tokens_per_s": row["batch"] / (ms / 1e3),
                    f"{prefix}pct_floor": 100 * row["floor_ms"] / ms})
    except Exception as e:  # noqa: BLE001 - one case's failure (out of memory too) must not end the section
        row[f"{prefix}error"] = err(e)
    cache = tok = None
    free(device)


def step_flops(name: str, batch: int, n_ctx: int, smoke: bool) -> float:
    """FLOPs of one decode step of ``batch`` tokens at ``n_ctx`` cached: 2 per matmul weight (lm_head too) per token,
    plus attention per head: MHA q·k and p·v over ``head_size``; absorbed MLA q·row over latent + rope, p·latent."""
    cfg = preset(VARIANTS[name], **(SMOKE_SHAPES if smoke else {}))
    with torch.device("meta"):
        model = GPT(cfg.replace(block_size=max(n_ctx + 2, 2)))
    weights = sum(p.numel() for n, p in model.named_parameters(remove_duplicate=False)  # a tied lm_head too
                  if p.dim() == 2 and "wte" not in n and "wpe" not in n)
    width = 2 * cfg.head_size if cfg.attention == "mha" else 2 * cfg.d_cached_latent + cfg.qk_rope_head_dim
    return float(batch) * (2 * weights + cfg.n_layer * 2 * cfg.n_head * n_ctx * width)


def add_floors(row: dict, flops: float, peak: float) -> dict:
    """A capacity row's compute floor (``flops`` / ``peak``) beside its bytes floor, ``bound``: the larger, and each
    path's ``*_pct_larger_floor``."""
    row["flops_per_step"] = flops
    row["compute_floor_ms"] = flops / peak * 1e3 if peak else None
    floors = {"compute": row["compute_floor_ms"] or 0, "bytes": row.get("floor_ms") or 0}  # a tie: compute
    if not any(floors.values()):
        return row
    row["bound"] = max(floors, key=floors.get)
    larger = row["larger_floor_ms"] = floors[row["bound"]]
    for label in ("sdpa", "split_kv"):
        if row.get(f"{label}_ms"):
            row[f"{label}_pct_larger_floor"] = 100 * larger / row[f"{label}_ms"]
    return row


def capacity(s: dict, device: torch.device, dtype: torch.dtype, bandwidth: float, smoke: bool) -> Iterator[dict]:
    """Per variant, context and row format: one sequence's bytes, the batch that :func:`fits`, a decode step at it
    (at most ``max_batch``) with SDPA and the kernel, both floors (``peak``), batch and tokens/s against MHA's row."""
    kernels = ["eager"] + (["triton"] if kernel_runs_here(device) is None else [])
    mha: dict = {}
    for name in s["variants"]:
        try:
            models = {k: build(name, k, max(s["ctx"]), smoke, device, dtype) for k in kernels}  # same weights
        except Exception as e:  # noqa: BLE001 - one variant's failure must not end the section
            yield dict(variant=name, rows="-", ctx=0, bytes_per_seq=0, max_batch=0, sdpa_error=err(e))
            continue
        m = models["eager"]
        for ctx, quant in itertools.product(s["ctx"], (None, "int8")):
            per_seq, weights = seq_bytes(m, ctx, quant), weight_bytes(m)
            n = fits(s["budget_gb"], per_seq, device)
            row = dict(variant=name, rows="int8" if quant else str(dtype).split(".")[-1], ctx=ctx,
                       bytes_per_seq=per_seq, budget_gb=s["budget_gb"], max_batch=n,
                       batch=min(n, s["max_batch"]), weight_bytes=weights)
            row["bytes_per_step"] = row["batch"] * per_seq + weights
            row["floor_ms"] = row["bytes_per_step"] / bandwidth * 1e3
            for k, model in models.items():
                label = "sdpa_" if k == "eager" else "split_kv_"
                if row["batch"] < 1:
                    row[f"{label}error"] = "no sequence fits the budget"
                else:
                    time_into(row, label, model, ctx, quant, s["steps"], smoke)
            base = mha.setdefault((ctx, row["rows"]), row) if name == "MHA" else mha.get((ctx, row["rows"]))
            for label in ("sdpa", "split_kv"):
                tps, ref = row.get(f"{label}_tokens_per_s"), base and base.get("sdpa_tokens_per_s")
                row[f"{label}_vs_mha_sdpa"] = tps / ref if tps and ref else None
            row["batch_vs_mha"] = n / base["max_batch"] if base and base["max_batch"] else None
            yield add_floors(row, step_flops(name, row["batch"], ctx, smoke), s["peak"])
        models = m = None
        free(device)


def kernel(s: dict, device: torch.device, dtype: torch.dtype, bandwidth: float, smoke: bool) -> Iterator[dict]:
    """The attention call alone, ``kernel_batch`` × ``kernel_keys``, one query per head, per ``kernel_cases``
    ``[label, query heads, row heads, row width, int8]``: SDPA against the kernel (own splits, ``kernel_splits``)."""
    batch, keys = s["kernel_batch"], s["kernel_keys"]
    run_kernel = kernel_runs_here(device) is None
    for label, hq, hkv, d, int8 in s["kernel_cases"]:
        row = dict(case=label, batch=batch, keys=keys)
        try:
            g = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(batch, hq, 1, d, device=device, dtype=dtype, generator=g)
            k = torch.randn(batch, hkv, keys, d, device=device, dtype=dtype, generator=g)
            shared = hkv == 1  # a latent is key and value: read once
            v = k if shared else torch.randn_like(k)
            kq, ks = quantize_int8(k) if int8 else (k, None)
            vq, vs = (kq, ks) if shared else quantize_int8(v) if int8 else (v, None)
            row["bytes_read"] = batch * hkv * keys * (d + 2 if int8 else d * k.element_size()) * (1 if shared else 2)
            kf = kq.to(dtype) * ks.to(dtype) if int8 else k  # the eager path attends over dequantised rows
            vf = kf if shared else (vq.to(dtype) * vs.to(dtype) if int8 else v)
            calls = {"sdpa": lambda: attend(q, kf, vf, scale=d ** -0.5)}
            for n in [None, *s["kernel_splits"]] if run_kernel else []:  # None: the kernel's own choice
                calls["split_kv" if n is None else f"split_kv_s{n}"] = (
                    lambda n=n: decode_attend(q, kq, vq, scale=d ** -0.5, k_scale=ks, v_scale=vs, num_splits=n))
            outs = {}
            for name, fn in calls.items():
                outs[name] = fn()
                ms = statistics.median(timer(device)(fn, s["steps"]))
                row.update({f"{name}_ms": ms, f"{name}_gbs": row["bytes_read"] / (ms / 1e3) / 1e9,
                            f"{name}_pct_bandwidth": 100 * row["bytes_read"] / (ms / 1e3) / bandwidth})
            if "split_kv" in outs:  # a sanity check of the run: the kernel against the eager path, same rows
                row["max_abs_diff"] = (outs["split_kv"].float() - outs["sdpa"].float()).abs().max().item()
                row["speedup"] = row["sdpa_ms"] / row["split_kv_ms"]
        except Exception as e:  # noqa: BLE001 - one case's failure must not end the section
            row["error"] = err(e)
        yield row
        q = k = v = kq = vq = kf = vf = outs = calls = None
        free(device)


def decode(s: dict, device: torch.device, dtype: torch.dtype, bandwidth: float, smoke: bool) -> Iterator[dict]:
    """One decode step at ``decode_batch`` × ``decode_ctx`` per ``decode_variants``: every SDPA row first (a sticky
    CUDA error of the kernel cannot cost the baselines), then the kernel's; against MHA's SDPA row."""
    batch, n_ctx, graph = s["decode_batch"], s["decode_ctx"], device.type == "cuda"
    base: dict = {}
    kernels = ["eager"] + (["triton"] if kernel_runs_here(device) is None else [])
    for kernel, (name, quant) in itertools.product(kernels, s["decode_variants"]):
        row = dict(variant=name, rows=quant or str(dtype).split(".")[-1],
                   path="sdpa" if kernel == "eager" else "split_kv", batch=batch, ctx=n_ctx, graph=graph)
        try:
            model = build(name, kernel, n_ctx, smoke, device, dtype)
            row["bytes_per_step"] = batch * seq_bytes(model, n_ctx, quant) + weight_bytes(model)
            row["floor_ms"] = row["bytes_per_step"] / bandwidth * 1e3
            time_into(row, "", model, n_ctx, quant, s["decode_steps"], smoke)
        except Exception as e:  # noqa: BLE001 - the model did not build
            row["error"] = err(e)
        if name == "MHA" and kernel == "eager" and "ms" in row:
            base[row["rows"]] = row["ms"]
        row["vs_mha_sdpa"] = row["ms"] / base[row["rows"]] if "ms" in row and row["rows"] in base else None
        model = None
        free(device)
        yield row


def profile_rows(events, variant: str, batch: int, n_ctx: int, top: int, cuda: bool) -> list[dict]:
    """The ``top`` kernels of a profiled step by self device time (self CPU time on CPU), with their share."""
    def t(e) -> float:  # older torch: self_cuda_time_total
        dev = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) if cuda else 0
        return float(dev or 0) if cuda else float(e.self_cpu_time_total)

    evs = [e for e in events if t(e) > 0]
    total = sum(t(e) for e in evs) or 1.0
    kernels = [(e.key[:80], e.count, t(e)) for e in sorted(evs, key=t, reverse=True)[:top]]
    return [dict(variant=variant, batch=batch, ctx=n_ctx, kernel=k, calls=n, ms=us / 1e3, pct_step=100 * (us / total))
            for k, n, us in kernels + [("(step total)", None, total)]]


def profile(s: dict, device: torch.device, dtype: torch.dtype, bandwidth: float, smoke: bool) -> Iterator[dict]:
    """Per ``profile_variants``: one eager step under ``torch.profiler`` at ``profile_ctx`` and the batch that
    :func:`fits` (at most ``profile_batch``): its top kernels."""
    from torch.profiler import ProfilerActivity, profile as profiler

    n_ctx, cuda = s["profile_ctx"], device.type == "cuda"
    for name in s["profile_variants"]:
        try:
            model = build(name, "eager", n_ctx, smoke, device, dtype)
            batch = max(1, min(fits(s["budget_gb"], seq_bytes(model, n_ctx, None), device), s["profile_batch"]))
            cache = filled_cache(model, batch, n_ctx, None)
            tok = torch.randint(0, model.cfg.vocab_size, (batch, 1), device=device)
            with torch.inference_mode():
                model(tok, cache=cache)  # warm-up
                cache.truncate(n_ctx)
                with profiler(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                    model(tok, cache=cache)
                    if cuda:
                        torch.cuda.synchronize()
            yield from profile_rows(prof.key_averages(), name, batch, n_ctx, s["profile_top"], cuda)
        except Exception as e:  # noqa: BLE001 - one variant's failure must not end the section
            yield dict(variant=name, kernel="-", error=err(e))
        model = cache = None
        free(device)


def formulations(q: torch.Tensor, s: torch.Tensor, scale: float, splits: int = 16) -> dict:
    """``name -> call`` of absorbed-MLA attention ``softmax(q s^T * scale) s``, ``q (B, 1, H, r)`` over the shared
    latent ``s (B, 1, T, r)``: SDPA's default, three ops, each fused SDPA kernel (latent padded to 8s), split-k."""
    b, _, t, r = s.shape
    dt = q.dtype

    def three():
        a = (q @ s.transpose(-1, -2)) * scale
        return torch.softmax(a, -1, dtype=torch.float32).to(dt) @ s

    def three_flat():  # (B, H, r) @ (B, r, T): one bmm per batch
        a = torch.bmm(q[:, 0], s[:, 0].transpose(1, 2)) * scale
        return torch.bmm(torch.softmax(a.float(), -1).to(dt), s[:, 0])

    def split_k():  # chunks of keys as batch, combined with their log-sum-exp
        c = t // splits
        sc = s[:, 0].reshape(b, splits, c, r)  # (B, C, c, r)
        a = torch.einsum("bhr,bkcr->bkhc", q[:, 0], sc).float() * scale  # (B, C, H, c)
        m = a.amax(-1, keepdim=True)
        p = torch.exp(a - m)
        den = p.sum(-1, keepdim=True)
        o = torch.einsum("bkhc,bkcr->bkhr", p.to(dt), sc).float()  # (B, C, H, r)
        w = torch.exp(m - m.amax(1, keepdim=True))
        return ((o * w).sum(1) / (den * w).sum(1)).to(dt)

    out = {"sdpa default": lambda: F.scaled_dot_product_attention(q, s, s, scale=scale), "3-op": three,
           "3-op bmm": three_flat}
    rp = (r + 7) // 8 * 8
    qp, sp = (F.pad(q, (0, rp - r)), F.pad(s, (0, rp - r))) if rp != r else (q, s)
    for name, be in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def fused(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(qp, sp, sp, scale=scale)
        out[f"{name} pad{rp}"] = fused
    out[f"split-k {splits}"] = split_k
    return out


def latent(s: dict, device: torch.device, dtype: torch.dtype, bandwidth: float, smoke: bool) -> Iterator[dict]:
    """Median ms of each :func:`formulations` per ``latent_batch`` × ``ctx`` × ``ranks``, 12 query heads of GPT-2
    small (scale 64^-0.5), after 5 untimed calls; None where a kernel cannot take the inputs."""
    for b, t, r in itertools.product(s["latent_batch"], s["ctx"], s["ranks"]):
        q = torch.randn(b, 1, 12, r, device=device, dtype=dtype)
        lat = torch.randn(b, 1, t, r, device=device, dtype=dtype)
        row = dict(batch=b, ctx=t, rank=r)
        for name, fn in formulations(q, lat, 64 ** -0.5).items():
            try:
                row[name] = median_of(timer(device), fn, s["latent_calls"], warmup=5)
            except RuntimeError:  # a kernel that cannot take these inputs
                row[name] = None
        yield row
