"""The sections ``benchmarks/gpu_check.py`` runs in their own processes: the split-KV kernel against SDPA, the
CUDA-graph decode step, serving capacity at a KV budget (with its bytes and compute floors), a profiled decode
step, the compiled training step and FlashAttention-4. Each adds its rows to the report as they come."""

from __future__ import annotations

import importlib
from typing import Optional

__all__ = ["CHILD_SECTIONS", "add_floors", "flash4_reason", "matmul_peak", "profile_rows", "step_flops"]

FLASH4_REASON = ("its wheels with the CUTLASS-DSL runtime (flash-attn-4 + nvidia-cutlass-dsl) are > 90 MB, more than "
                 "the 64 MiB one device call can carry")


def _free(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def section_kernel(rep, sz: dict, ctx: dict) -> None:
    from types import SimpleNamespace

    serving = importlib.import_module("benchmarks.lib.serving_bench")
    device, dtype = ctx["device"], ctx["dtype"]
    args = SimpleNamespace(smoke=ctx["smoke"], kernel_splits=sz["kernel_splits"], steps=sz["kernel_steps"])
    reason = serving.kernel_runs_here(device)
    rep.update("kernel", summary=dict(bandwidth_gbs=ctx["bandwidth"] / 1e9, kernel="runs" if reason is None else
                                      f"not run ({reason})"))
    for case in serving.kernel_cases(ctx["smoke"]):
        try:
            row = serving.bench_kernel(args, device, dtype, ctx["bandwidth"], lambda xs, desc: xs, cases=[case])[0]
            if row.get("split_kv_ms"):
                row["speedup"] = row["sdpa_ms"] / row["split_kv_ms"]
        except Exception as e:  # noqa: BLE001 - one case's failure must not end the section
            row = dict(case=case[0], error=_err(e))
        rep.add_row("kernel", row)
        _free(device)


def section_decode(rep, sz: dict, ctx: dict) -> None:
    import torch

    serving = importlib.import_module("benchmarks.lib.serving_bench")
    device, dtype, smoke = ctx["device"], ctx["dtype"], ctx["smoke"]
    batch, n_ctx = sz["decode_batch"], sz["decode_ctx"]
    graph = device.type == "cuda"
    reason = serving.kernel_runs_here(device)
    kernels = ["eager"] + (["triton"] if reason is None else [])
    rep.update("decode", summary=dict(bandwidth_gbs=ctx["bandwidth"] / 1e9, graph=graph,
                                      kernel="runs" if reason is None else f"not run ({reason})"))
    for kernel in kernels:  # every SDPA row first: a kernel fault (a sticky CUDA error) cannot cost the baselines
        for name, quant in sz["decode_variants"]:
            row = dict(variant=name, rows=quant or str(dtype).split(".")[-1],
                       path="sdpa" if kernel == "eager" else "split_kv", batch=batch, ctx=n_ctx, graph=graph)
            try:
                model = serving.build(name, kernel, n_ctx, smoke, device, dtype)
                weights = sum(p.numel() * p.element_size() for p in model.parameters())
                step_bytes = batch * serving.seq_bytes(model, n_ctx, quant) + weights
                row.update(bytes_per_step=step_bytes, floor_ms=step_bytes / ctx["bandwidth"] * 1e3)
                ms = serving.decode_step_ms(model, batch, n_ctx, quant, sz["decode_steps"], graph,
                                            warmup=1 if smoke else 2)
                row.update(ms=ms, tokens_per_s=batch / (ms / 1e3), pct_floor=100 * row["floor_ms"] / ms)
            except torch.cuda.OutOfMemoryError:
                row["error"] = "out of memory"
            except Exception as e:  # noqa: BLE001
                row["error"] = _err(e)
            model = None
            _free(device)
            rows = rep.section("decode")["rows"] + [row]
            base = next((r.get("ms") for r in rows if r["variant"] == "MHA" and r["path"] == "sdpa"
                         and r["rows"] == row["rows"] and r.get("ms")), None)
            for r in rows:
                if r.get("ms") and base:
                    r["vs_mha_sdpa"] = r["ms"] / base
            rep.set_rows("decode", rows)


def section_capacity(rep, sz: dict, ctx: dict) -> None:
    from types import SimpleNamespace

    serving = importlib.import_module("benchmarks.lib.serving_bench")
    device, dtype = ctx["device"], ctx["dtype"]
    rep.update("capacity", summary=dict(bandwidth_gbs=ctx["bandwidth"] / 1e9, matmul_tflops=ctx["matmul_peak"] / 1e12,
                                        budget_gb=sz["capacity_budget_gb"],
                                        max_batch_run=sz["capacity_max_batch"], claim=serving.CLAIM))
    for name in sz["capacity_variants"]:
        args = SimpleNamespace(variants=[name], ctx=sz["capacity_ctx"], budget_gb=sz["capacity_budget_gb"],
                               max_batch=sz["capacity_max_batch"], steps=sz["capacity_steps"], smoke=ctx["smoke"])
        try:
            new = serving.bench_capacity(args, device, dtype, ctx["bandwidth"], lambda xs, desc: xs)
        except Exception as e:  # noqa: BLE001
            new = [dict(variant=name, rows="-", ctx=0, bytes_per_seq=0, max_batch=0, sdpa_error=_err(e))]
        _free(device)
        for row in new:
            add_floors(row, step_flops(name, row.get("batch", 0), row.get("ctx", 0), ctx["smoke"]),
                       ctx["matmul_peak"])
        rep.set_rows("capacity", serving.compare_to_mha(rep.section("capacity")["rows"] + new))


def model_shapes(name: str, smoke: bool):
    """The config ``serving.build`` gives variant ``name`` (no weights built)."""
    serving = importlib.import_module("benchmarks.lib.serving_bench")
    return serving.preset(serving.VARIANTS[name], **(serving.SMOKE_SHAPES if smoke else {}))


def step_flops(name: str, batch: int, n_ctx: int, smoke: bool) -> float:
    """FLOPs of one decode step of ``batch`` tokens at ``n_ctx`` cached tokens: 2 per weight of every matmul
    (attention projections, MLP, lm_head; the embedding lookup is free) per token, plus attention — MHA: q·k and
    p·v over ``head_size`` per head; MLA (absorbed): q·row over ``latent + rope`` and p·latent per head."""
    import torch

    from models import GPT

    cfg = model_shapes(name, smoke)
    with torch.device("meta"):
        model = GPT(cfg.replace(block_size=max(n_ctx + 2, 2)))
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n
                  and "wpe" not in n)
    if cfg.tie_embeddings:
        weights += cfg.vocab_size * cfg.d_model  # the tied lm_head is a matmul too
    if cfg.attention == "mha":
        attn = 2 * cfg.n_head * n_ctx * (cfg.head_size + cfg.head_size)
    else:
        attn = 2 * cfg.n_head * n_ctx * (2 * cfg.d_cached_latent + cfg.qk_rope_head_dim)
    return float(batch) * (2 * weights + cfg.n_layer * attn)


def add_floors(row: dict, flops: float, peak: float) -> dict:
    """Both floors of a capacity row: bytes (``floor_ms``, already there) and compute (``flops`` over ``peak``
    FLOP/s); ``bound`` names the larger; each path's ``*_pct_larger_floor`` is that floor over its time."""
    row["flops_per_step"] = flops
    row["compute_floor_ms"] = flops / peak * 1e3 if peak else None
    floors = [f for f in (row.get("floor_ms"), row["compute_floor_ms"]) if f]
    if not floors:
        return row
    larger = max(floors)
    row["bound"] = "compute" if row["compute_floor_ms"] and row["compute_floor_ms"] >= (row.get("floor_ms") or 0) \
        else "bytes"
    row["larger_floor_ms"] = larger
    for label in ("sdpa", "split_kv"):
        if row.get(f"{label}_ms"):
            row[f"{label}_pct_larger_floor"] = 100 * larger / row[f"{label}_ms"]
    return row


def matmul_peak(device, dtype, n: int) -> float:
    """FLOP/s of an ``n``×``n``×``n`` matmul in ``dtype`` (median of 10)."""
    import statistics

    import torch

    serving = importlib.import_module("benchmarks.lib.serving_bench")
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    ms = statistics.median(serving.timer(device)(lambda: a @ b, 10))
    return 2 * n ** 3 / (ms / 1e3)


def profile_rows(events, variant: str, batch: int, n_ctx: int, top: int, cuda: bool) -> list[dict]:
    """The ``top`` kernels of a profiled step by self device time (self CPU time on CPU), with their share."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"

    def t(e) -> float:
        return float(getattr(e, key, 0) or getattr(e, "self_cuda_time_total", 0) or 0) if cuda else \
            float(e.self_cpu_time_total)

    evs = [e for e in events if t(e) > 0]
    total = sum(t(e) for e in evs) or 1.0
    rows = [dict(variant=variant, batch=batch, ctx=n_ctx, kernel=e.key[:80], calls=e.count, ms=t(e) / 1e3,
                 pct_step=100 * t(e) / total) for e in sorted(evs, key=t, reverse=True)[:top]]
    rows.append(dict(variant=variant, batch=batch, ctx=n_ctx, kernel="(step total)", calls=None, ms=total / 1e3,
                     pct_step=100.0))
    return rows


def section_profile(rep, sz: dict, ctx: dict) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    serving = importlib.import_module("benchmarks.lib.serving_bench")
    device, dtype, smoke = ctx["device"], ctx["dtype"], ctx["smoke"]
    n_ctx, cuda = sz["profile_ctx"], device.type == "cuda"
    for name in sz["profile_variants"]:
        try:
            model = serving.build(name, "eager", n_ctx, smoke, device, dtype)
            per_seq = serving.seq_bytes(model, n_ctx, None)
            budget = sz["capacity_budget_gb"] * 1e9
            if cuda:
                budget = min(budget, torch.cuda.mem_get_info()[0] - serving.RESERVE_BYTES)
            batch = max(1, min(int(budget // per_seq), sz["profile_batch"]))
            cache = serving.filled_cache(model, batch, n_ctx, None)
            tok = torch.randint(0, model.cfg.vocab_size, (batch, 1), device=device)
            with torch.inference_mode():
                model(tok, cache=cache)  # warm-up
                cache.truncate(n_ctx)
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=acts) as prof:
                    model(tok, cache=cache)
                    if cuda:
                        torch.cuda.synchronize()
            for row in profile_rows(prof.key_averages(), name, batch, n_ctx, sz["profile_top"], cuda):
                rep.add_row("profile", row)
        except Exception as e:  # noqa: BLE001 - one variant's failure must not end the section
            rep.add_row("profile", dict(variant=name, kernel="-", error=_err(e)))
        model = cache = None
        _free(device)


def section_train(rep, sz: dict, ctx: dict) -> None:
    import torch

    if ctx["device"].type != "cuda":
        rep.update("train", status="skipped", reason="the training step is timed on CUDA only")
        return
    gpu = importlib.import_module("benchmarks.lib.gpu_bench")
    torch.backends.cuda.matmul.allow_tf32 = True
    for label in sz["train_models"]:
        try:
            new = gpu.bench_train(sz["train_batch"], sz["train_t"], sz["train_rounds"], sz["train_steps"], True,
                                  ctx["smoke"], only=[label])
        except Exception as e:  # noqa: BLE001
            new = [dict(model=label, mode="-", optimizer="-", error=_err(e))]
        _free(ctx["device"])
        rows = rep.section("train")["rows"] + new
        mha = {r["mode"]: r["median_ms"] for r in rows
               if r["model"] == "ours mha" and r["optimizer"].startswith("fused") and r.get("median_ms")}
        for r in rows:
            r["vs_ours_mha_same_mode"] = r["median_ms"] / mha[r["mode"]] if r.get("median_ms") and r["mode"] in mha \
                else None
            r.pop("vs_reference_same_mode", None)
        rep.set_rows("train", rows)


def flash4_reason() -> Optional[str]:
    """Why FlashAttention-4 cannot run here, or None."""
    import torch

    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install
        return f"FlashAttention-4 is not importable ({_err(e)}): {FLASH4_REASON}"
    if not torch.cuda.is_available():
        return "FlashAttention-4 needs CUDA"
    if torch.cuda.get_device_capability() < (9, 0):
        return f"FlashAttention-4 needs compute capability >= 9.0, this is {torch.cuda.get_device_capability()}"
    return None


def section_flash4(rep, sz: dict, ctx: dict) -> None:
    import statistics

    import torch

    reason = flash4_reason()
    if reason is not None:
        rep.update("flash4", status="skipped", reason=reason)
        return
    from flash_attn.cute import flash_attn_func  # type: ignore[import-not-found]

    from benchmarks.harness.timing import cuda_time
    from models.attention import FlashImpl, attend

    impl = FlashImpl("flash-attn-4", flash_attn_func, (9, 0), returns_lse=True)
    b, h, t, d = sz["flash_shape"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    for call, (qq, kk, vv) in {f"MHA prefill {b}x{h}x{t}x{d}": (q, k, v),
                               f"GQA-4 prefill {b}x{h}x{t}x{d}": (q, k[:, :h // 4], v[:, :h // 4])}.items():
        row = dict(call=call, impl=impl.name)
        try:
            sd = lambda: attend(qq, kk, vv, scale=d ** -0.5, backend="sdpa")  # noqa: E731
            fl = lambda: attend(qq, kk, vv, scale=d ** -0.5, backend="flash", flash=impl)  # noqa: E731
            row["max_abs_diff"] = (fl().float() - sd().float()).abs().max().item()
            row["sdpa_ms"] = statistics.median(cuda_time(sd, sz["flash_calls"]))
            row["flash_ms"] = statistics.median(cuda_time(fl, sz["flash_calls"]))
            row["speedup"] = row["sdpa_ms"] / row["flash_ms"]
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e)
        rep.add_row("flash4", row)


CHILD_SECTIONS = {"kernel": section_kernel, "decode": section_decode, "capacity": section_capacity,
                  "profile": section_profile, "train": section_train, "flash4": section_flash4}
