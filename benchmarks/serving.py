"""Serving capacity and decode throughput of every cache, side by side: how many sequences fit a memory budget, how
fast a CUDA-graph decode step runs at that batch with SDPA and with the split-KV Triton kernel (models.kernels), and
how close each step comes to the bandwidth floor. Plus the kernel alone over 16k keys.

    python benchmarks/serving.py                          # CUDA: results/serving_<device>.json and .md
    python benchmarks/serving.py --budget-gb 24 --ctx 1024 4096 16384 --sections capacity kernel
    python benchmarks/serving.py --smoke --out /tmp/s.json  # tiny shapes on CPU (or GPU): a smoke run, seconds

Sections (``--sections``):

* ``capacity`` — for MHA, GQA-4 (4 KV heads), MQA, MLA, KVSplice-50 / -90 (the 124M presets, random weights, bf16),
  each with its rows at bf16 and as int8 + fp16 scales, at each context: the bytes one sequence's cache holds
  (``context + 1`` tokens), the largest batch whose caches fit ``--budget-gb`` (and, on a GPU, the free memory less
  the weights and a reserve), then one decode step at that batch (capped by ``--max-batch``) replayed from a CUDA
  graph (``models.graph_decode.GraphDecoder``; the step is rolled back, so the context stays fixed), once with the
  SDPA path (``decode_kernel="eager"``) and once with the split-KV kernel (``"triton"``): median ms, tokens/s, bytes
  read per step (cache + weights) against the floor ``bytes / copy bandwidth`` (measured in the same run).
* ``kernel`` — the attention call alone, batch 64 over 16k keys, one query per head: latents of 26 / 77 / 128 / 256
  dims under 12 heads, MHA rows (12 KV heads of 64), GQA-4 rows, int8 latents; SDPA (the eager path) vs the
  kernel, GB/s of rows read and % of copy bandwidth.

``--smoke``: two-layer shapes, contexts of 32 / 64, a budget of a few MB, eager steps (no CUDA graph without CUDA);
the kernel columns run only where they can (CUDA, or Triton's interpreter with ``TRITON_INTERPRET=1``). Its numbers
say nothing about speed; it proves the script runs. FlashAttention-4 (``attn_backend="flash"``) does not take the
fixed-capacity view's key mask, so the CUDA-graph step cannot use it; it is not timed here.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
from typing import Callable, Optional

import torch

if __name__ == "__main__" and not __package__:  # run as a file: the repository first on sys.path (benchmarks/_root.py)
    import _root  # noqa: F401

from benchmarks.harness.header import command as command_line, revision  # noqa: E402
from benchmarks.harness.options import UsageError, add_out, add_progress, command, parser  # noqa: E402
from benchmarks.harness.paths import RESULTS  # noqa: E402
from benchmarks.harness.timing import cuda_time, wall_time  # noqa: E402

from kvsplice.report.tables import cell
from models import GPT, preset
from models.attention import attend
from models.quant import SCALE, quantize_int8
from models.checkpoint import atomic_write
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


# ------------------------------------------------------------------------------------------------- report
def markdown(report: dict) -> str:
    out = [f"# Serving benchmark — {report['device']}", "",
           f"torch {report['torch']}, triton {report['triton']}; copy bandwidth {report['bandwidth_gbs']:.0f} GB/s "
           f"(measured in this run). Split-KV kernel: {report['kernel_status']}. Command: `{report['command']}`", ""]
    if report.get("smoke"):
        out += ["**Smoke run**: tiny shapes and eager steps; the numbers say nothing about speed.", ""]
    if report.get("capacity"):
        out += [f"## Capacity and decode throughput at a {report['budget_gb']:g} GB budget", "",
                f"Claim: {CLAIM}. Measured: the rows below (max batch = budget / bytes per sequence; the step runs at "
                f"min(max batch, --max-batch {report['max_batch']})).", "",
                "| variant | rows | context | bytes/seq | max batch | x MHA | batch run | SDPA ms | SDPA tok/s | "
                "split-KV ms | split-KV tok/s | split-KV vs MHA SDPA | floor ms | split-KV % floor |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["capacity"]:
            out.append(
                f"| {r['variant']} | {r['rows']} | {r['ctx']:,} | {r['bytes_per_seq']:,} | {r['max_batch']:,} | "
                f"{cell(r.get('batch_vs_mha'), '{:.1f}x')} | {r['batch']:,} | "
                f"{cell(r.get('sdpa_ms')) if 'sdpa_error' not in r else r['sdpa_error']} | "
                f"{cell(r.get('sdpa_tokens_per_s'), '{:,.0f}')} | "
                f"{cell(r.get('split_kv_ms')) if 'split_kv_error' not in r else r['split_kv_error']} | "
                f"{cell(r.get('split_kv_tokens_per_s'), '{:,.0f}')} | {cell(r.get('split_kv_vs_mha_sdpa'), '{:.1f}x')} | "
                f"{r['floor_ms']:.3f} | {cell(r.get('split_kv_pct_floor'), '{:.0f} %')} |")
        out.append("")
    if report.get("kernel"):
        k0 = report["kernel"][0]
        out += [f"## The attention call alone: batch {k0['batch']}, {k0['keys']:,} keys, one query per head", "",
                "| rows | bytes read | SDPA ms | SDPA % bandwidth | split-KV ms | split-KV GB/s | split-KV % bandwidth | "
                "max abs diff |", "|---|---|---|---|---|---|---|---|"]
        for r in report["kernel"]:
            out.append(f"| {r['case']} | {r['bytes_read']:,} | {cell(r.get('sdpa_ms'))} | "
                       f"{cell(r.get('sdpa_pct_bandwidth'), '{:.0f} %')} | {cell(r.get('split_kv_ms'))} | "
                       f"{cell(r.get('split_kv_gbs'), '{:.0f}')} | {cell(r.get('split_kv_pct_bandwidth'), '{:.0f} %')} | "
                       f"{cell(r.get('max_abs_diff'), '{:.1e}')} |")
        splits = report.get("kernel_splits") or []
        if splits and "split_kv_ms" in k0:
            out += ["", "Split count forced (`--kernel-splits`): ms per call", "",
                    "| rows | auto | " + " | ".join(f"{n} splits" for n in splits) + " |",
                    "|---|---|" + "---|" * len(splits)]
            for r in report["kernel"]:
                out.append(f"| {r['case']} | {cell(r.get('split_kv_ms'))} | "
                           + " | ".join(cell(r.get(f"split_kv_s{n}_ms")) for n in splits) + " |")
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------- main
def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__file__, __doc__, raw=True)
    p.add_argument("--sections", nargs="+", choices=("capacity", "kernel"), default=["capacity", "kernel"])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="NAME",
                   help=f"caches of the capacity section (default all: {' '.join(VARIANTS)})")
    p.add_argument("--budget-gb", type=float, default=24.0, help="memory budget for the caches (GB, 1e9 bytes)")
    p.add_argument("--ctx", type=int, nargs="+", default=None, help="contexts (default 1024 4096 16384)")
    p.add_argument("--max-batch", type=int, default=16384, help="largest batch actually run")
    p.add_argument("--kernel-splits", type=int, nargs="*", default=[], metavar="N",
                   help="kernel section: also time the kernel at these forced split counts (tuning)")
    p.add_argument("--steps", type=int, default=None, help="timed steps / calls per case (default 20; smoke 2)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, eager steps: proves the script runs")
    add_out(p, None, "default results/serving_<device>.json (+ .md)")
    add_progress(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.ctx = args.ctx or [32, 64]
        args.steps = args.steps or 2
        args.budget_gb = min(args.budget_gb, 0.0002)
        args.max_batch = min(args.max_batch, 4)
    args.ctx = args.ctx or [1024, 4096, 16384]
    args.steps = args.steps or 20
    if any(c < 1 for c in args.ctx):
        raise UsageError(f"--ctx must be >= 1, got {args.ctx}")
    if args.budget_gb <= 0 or args.max_batch < 1 or args.steps < 1 or any(n < 1 for n in args.kernel_splits):
        raise UsageError("--budget-gb must be > 0, --max-batch, --steps and --kernel-splits >= 1")
    if not args.smoke and not torch.cuda.is_available():
        raise UsageError("no CUDA device: this benchmark measures a GPU (use --smoke for a CPU run)")
    if args.out is not None and args.out.suffix != ".json":
        raise UsageError(f"--out must name a .json file (the .md goes beside it), got {args.out}")
    return args


@command
def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({platform.machine()})"
    tag = "".join(c if c.isalnum() else "_" for c in name.split("(")[0].strip()).lower()
    out = args.out or RESULTS / f"serving_{tag}{'_smoke' if args.smoke else ''}.json"
    if not args.progress:
        progress = lambda xs, desc: xs  # noqa: E731
    else:
        from tqdm import tqdm

        progress = lambda xs, desc: tqdm(xs, desc=desc, file=sys.stderr)  # noqa: E731
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    bw = copy_bandwidth(device, 2**21 if args.smoke else 2**31)
    reason = kernel_runs_here(device)
    report = dict(device=name, torch=torch.__version__, triton=tv, smoke=args.smoke, budget_gb=args.budget_gb,
                  max_batch=args.max_batch, kernel_splits=args.kernel_splits, bandwidth_gbs=bw / 1e9, dtype=str(dtype),
                  kernel_status="runs" if reason is None else f"not run ({reason})", claim=CLAIM,
                  command=command_line(__file__, argv), revision=revision())

    def save() -> str:  # after every section: a run cut short keeps what it measured
        md = markdown(report)
        atomic_write(out, lambda p: p.write_text(json.dumps(report, indent=1) + "\n"))
        atomic_write(out.with_suffix(".md"), lambda p: p.write_text(md + "\n"))
        return md

    if "capacity" in args.sections:
        report["capacity"] = bench_capacity(args, device, dtype, bw, progress)
        save()
    if "kernel" in args.sections:
        report["kernel"] = bench_kernel(args, device, dtype, bw, progress)
    print(save())
    print(f"wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
