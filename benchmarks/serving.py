"""Serving capacity and decode throughput of every cache, side by side: how many sequences fit a memory budget, how
fast a CUDA-graph decode step runs at that batch with SDPA and with the split-KV Triton kernel (models.kernels), and
how close each step comes to the bandwidth floor. Plus the kernel alone over 16k keys.

    python -m benchmarks.serving                           # CUDA: results/serving_<device>.json and .md
    python -m benchmarks.serving --budget-gb 24 --ctx 1024 4096 16384 --sections capacity kernel
    python -m benchmarks.serving --smoke --out /tmp/s     # tiny shapes on CPU (or GPU): a smoke run, seconds

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

import platform
from types import SimpleNamespace

from benchmarks.harness.header import version
from benchmarks.harness.options import UsageError, add_progress
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.runner import Study
from benchmarks.lib.serving_bench import CLAIM, VARIANTS


def options(p) -> None:
    p.add_argument("--sections", nargs="+", choices=("capacity", "kernel"), help="default capacity kernel")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), metavar="NAME",
                   help=f"caches of the capacity section (default all: {' '.join(VARIANTS)})")
    p.add_argument("--budget-gb", type=float, help="memory budget for the caches (GB, 1e9 bytes; default 24)")
    p.add_argument("--ctx", type=int, nargs="+", help="contexts (default 1024 4096 16384)")
    p.add_argument("--max-batch", type=int, help="largest batch actually run (default 16384)")
    p.add_argument("--kernel-splits", type=int, nargs="*", metavar="N",
                   help="kernel section: also time the kernel at these forced split counts (tuning)")
    p.add_argument("--steps", type=int, help="timed steps / calls per case (default 20; smoke 2)")
    add_progress(p)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})"


def out_stem(args):
    tag = "".join(c if c.isalnum() else "_" for c in device_name().split("(")[0].strip()).lower()
    return RESULTS / f"serving_{tag}"


def rows(run):
    import torch

    from benchmarks.lib.serving_bench import bench_capacity, bench_kernel, copy_bandwidth, kernel_runs_here

    smoke = run.size == "smoke"
    if not smoke and not torch.cuda.is_available():
        raise UsageError("no CUDA device: this benchmark measures a GPU (use --smoke for a CPU run)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bw = copy_bandwidth(device, 2**21 if smoke else 2**31)
    reason = kernel_runs_here(device)
    run.notes.update(device=device_name(), torch=torch.__version__, triton=version("triton"), smoke=smoke,
                     bandwidth_gbs=bw / 1e9,
                     dtype=str(dtype), kernel_status="runs" if reason is None else f"not run ({reason})", claim=CLAIM)
    args = SimpleNamespace(**run.settings, smoke=smoke)
    if run.args.progress:
        from tqdm import tqdm

        progress = lambda xs, desc: tqdm(xs, desc=desc)  # noqa: E731
    else:
        progress = lambda xs, desc: xs  # noqa: E731
    if "capacity" in run["sections"]:
        yield from ({"section": "capacity", **r} for r in bench_capacity(args, device, dtype, bw, progress))
    if "kernel" in run["sections"]:
        yield from ({"section": "kernel", **r} for r in bench_kernel(args, device, dtype, bw, progress))


def markdown(run, rows) -> str:
    from benchmarks.lib.serving_report import capacity_table, kernel_tables

    n = run.notes
    out = [f"# Serving benchmark — {n['device']}", "",
           f"torch {n['torch']}, triton {n['triton']}; copy bandwidth {n['bandwidth_gbs']:.0f} GB/s "
           f"(measured in this run). Split-KV kernel: {n['kernel_status']}.", ""]
    if n["smoke"]:
        out += ["**Smoke run**: tiny shapes and eager steps; the numbers say nothing about speed.", ""]
    cap, ker = ([r for r in rows if r["section"] == s] for s in ("capacity", "kernel"))
    if cap:
        out += capacity_table(cap, run["budget_gb"], run["max_batch"])
    if ker:
        out += kernel_tables(ker, run["kernel_splits"])
    return "\n".join(out)


STUDY = Study("serving", __doc__, rows, options=options, markdown=markdown, summary=lambda run, rows: run.notes,
              out=out_stem, bounds={"budget_gb": (1e-9, 1e6), "ctx": (1, 1 << 20), "max_batch": (1, 1 << 24),
                                    "steps": (1, 10_000), "kernel_splits": (1, 4096)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
