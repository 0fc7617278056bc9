"""The package on whatever GPU is present, side by side in one run (sizes in ``benchmarks/studies/gpu.yaml``; bf16,
CUDA events; medians of interleaved rounds):

    python -m benchmarks.gpu                       # everything; results/gpu_<device>.json and .md
    python -m benchmarks.gpu --sections decode --batch 8 --ctx 1024 4096
    python -m benchmarks.gpu --smoke               # tiny shapes, a smoke run (seconds): gpu_<device>_smoke

``sdpa``: one decode-shaped SDPA call per kernel choice (torch's default, each kernel first, the package's order).
``train``: one 124M step, the nanoGPT-style reference (:mod:`benchmarks.lib.reference_gpt`) and ours (MHA / MLA /
KVSplice-90), eager and compiled; MFU = (6·params + 12·L·d·T) · tokens / time / peak. ``decode``: ours eager and
``+graph`` against transformers' GPT-2 (DynamicCache / StaticCache) and the bytes floor. ``flash4``: vs SDPA.
"""

from __future__ import annotations

import platform

from benchmarks.harness.header import device_tag, version
from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.runner import Study

SECTIONS = ("sdpa", "train", "decode", "flash4")


def options(p) -> None:
    p.add_argument("--sections", nargs="+", choices=SECTIONS, help="default: all")
    p.add_argument("--batch", type=int, nargs="+", help="decode batch sizes")
    p.add_argument("--ctx", type=int, nargs="+", help="decode contexts")
    p.add_argument("--decode-steps", dest="decode_steps", type=int, help="timed decode steps per variant and round")
    p.add_argument("--rounds", type=int, help="interleaved rounds")
    p.add_argument("--train-batch", dest="train_batch", type=int, help="training batch")
    p.add_argument("--train-steps", dest="train_steps", type=int, help="timed training steps per case and round")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile training cases")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' GPT-2 in the decode section")


def out_stem(args):
    """``results/gpu_<device>``: the device's family names the file; no CUDA device: a one-line error (exit 2)."""
    import torch

    if not torch.cuda.is_available():
        raise UsageError("no CUDA device (this benchmark measures a GPU)")
    return RESULTS / f"gpu_{device_tag(torch.cuda.get_device_name())}"


def rows(run):
    import torch

    from benchmarks.lib import gpu_bench as g
    from benchmarks.lib.serving_bench import copy_bandwidth
    from models.attention import flash_impl

    out_stem(run.args)  # no CUDA: its one-line error, with --out too
    torch.backends.cuda.matmul.allow_tf32 = True
    impl = flash_impl()
    bw = copy_bandwidth(torch.device("cuda"), 2**31)  # 2 GiB read + written
    run.notes.update(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                     torch=torch.__version__, cuda=torch.version.cuda, transformers=version("transformers"),
                     python=platform.python_version(),
                     flash_impl="none (PyTorch SDPA kernels)" if impl is None else impl.name,
                     peak_bf16_flops=g.peak_flops(), bandwidth_gbs=bw / 1e9)
    s = dict(run.settings, quick=run.size == "smoke", bandwidth=bw, compile=not run.args.no_compile,
             hf=not run.args.no_hf)  # what the benches read
    for name in run["sections"]:
        reason = g.flash4_reason() if name == "flash4" else None
        if reason:  # a section that cannot run here: its reason in the report (gpu_check: the section skipped)
            run.notes[name] = reason
            continue
        yield from ({"section": name, **r} for r in getattr(g, f"bench_{name}")(s))


STUDY = Study("gpu", __doc__, rows, options=options, summary=lambda run, rows: run.notes, out=out_stem, threads=None,
              bounds={"batch": (1, 1 << 16), "ctx": (1, 1 << 20), "decode_steps": (1, 10000), "rounds": (1, 1000),
                      "train_batch": (1, 4096), "train_steps": (1, 10000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
