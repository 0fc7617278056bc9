"""Serving capacity and decode throughput of every cache (124M presets, random weights) with SDPA and the split-KV
Triton kernel (models.kernels), against bytes and compute floors measured in the run (``studies/serving.yaml``).

    python -m benchmarks.serving                           # CUDA: results/serving_<device>.json and .md
    python -m benchmarks.serving --budget-gb 24 --ctx 1024 4096 16384 --sections capacity kernel
    python -m benchmarks.serving --smoke --out /tmp/s     # tiny shapes on CPU (or GPU): a smoke run, seconds

``capacity``: per cache, row format and context: one sequence's bytes, the batch within ``--budget-gb`` (and free
memory), one step at it (at most ``--max-batch``). ``kernel``: the attention call alone, SDPA vs the kernel (and at
``--kernel-splits``). ``decode``: the CUDA-graph step at batch 8 / 16k. ``profile``: one eager step by kernel.
``latent``: absorbed MLA's formulations. ``gpu_check`` runs the first four at ``--size check``. ``--smoke``: tiny
shapes, eager steps, the kernel on Triton's interpreter on CPU. FlashAttention-4 (no key mask) is not timed here.
"""

from __future__ import annotations

import platform

from benchmarks.harness.header import device_tag, version
from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.runner import Study
from benchmarks.harness.timing import median_of
from benchmarks.lib.serving_bench import VARIANTS

SECTIONS = ("capacity", "kernel", "decode", "profile", "latent")


def options(p) -> None:
    p.add_argument("--sections", nargs="+", choices=SECTIONS, help="default capacity kernel")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), metavar="NAME",
                   help=f"caches of the capacity section (default all: {' '.join(VARIANTS)})")
    p.add_argument("--budget-gb", type=float, help="memory budget for the caches (GB, 1e9 bytes; default 24)")
    p.add_argument("--ctx", type=int, nargs="+", help="contexts (default 1024 4096 16384)")
    p.add_argument("--max-batch", type=int, help="largest batch actually run (default 16384)")
    p.add_argument("--kernel-splits", type=int, nargs="*", metavar="N",
                   help="kernel section: also time the kernel at these forced split counts (tuning)")
    p.add_argument("--steps", type=int, help="timed steps / calls per case (default 20; smoke 2)")


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})"


def out_stem(args):
    return RESULTS / f"serving_{device_tag(device_name().split('(')[0])}"


def rows(run):
    import torch

    from benchmarks.lib import serving_bench as sb

    smoke = run.size == "smoke"
    if not smoke and not torch.cuda.is_available():
        raise UsageError("no CUDA device: this benchmark measures a GPU (use --smoke for a CPU run)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bw = sb.copy_bandwidth(device, 2**21 if smoke else 2**31)
    reason = sb.kernel_runs_here(device)
    run.notes.update(device=device_name(), torch=torch.__version__, triton=version("triton"), bandwidth_gbs=bw / 1e9,
                     dtype=str(dtype), kernel_status="runs" if reason is None else f"not run ({reason})")
    if smoke:
        run.notes["smoke_run"] = "tiny shapes and eager steps"
    peak = 0.0
    if "capacity" in run["sections"]:  # the compute floor's peak (an n^3 matmul, median of 10), and the claim
        a, b = (torch.randn(run["matmul_n"], run["matmul_n"], device=device, dtype=dtype) for _ in range(2))
        peak = 2 * run["matmul_n"] ** 3 / median_of(sb.timer(device), lambda: a @ b, 10, warmup=1) * 1e3
        run.notes.update(matmul_tflops=peak / 1e12, claim=sb.CLAIM)
    for name in run["sections"]:
        for row in getattr(sb, name)(dict(run.settings, peak=peak), device, dtype, bw, smoke):
            if row.get("kernel", "(step total)") == "(step total)":  # a line per case (per profile, not kernel)
                run.say(f"{name}: " + ", ".join(f"{k} {row[k]}" for k in ("variant", "case", "rows", "path", "batch",
                                                                           "ctx", "rank") if k in row))
            yield {"section": name, **row}


STUDY = Study("serving", __doc__, rows, options=options, summary=lambda run, rows: run.notes, out=out_stem,
              bounds={"budget_gb": (1e-9, 1e6), "ctx": (1, 1 << 20), "max_batch": (1, 1 << 24), "steps": (1, 10_000),
                      "kernel_splits": (1, 4096)})  # the options' (the YAML's other sizes are the study's own)
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
