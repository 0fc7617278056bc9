"""The package on whatever GPU is present, side by side in one run: SDPA kernels for decode, the training step
(ours vs a nanoGPT-style reference, eager and compiled, MFU) and the decode step (ours, eager and CUDA-graph, vs
transformers' GPT-2 with DynamicCache / StaticCache).

    python -m benchmarks.gpu                       # everything; results/gpu_<device>.json and .md
    python -m benchmarks.gpu --sections decode --batch 8 --ctx 1024 4096
    python -m benchmarks.gpu --quick               # tiny shapes, a smoke run (seconds): gpu_<device>_quick

Sections (``--sections``):

* ``sdpa`` — one ``scaled_dot_product_attention`` call as a decode step makes it (batch 8, 12 heads, one query, head
  dim 64, bf16) over a key length that grows by one per call, for torch's default kernel choice, each kernel put
  first in SDPA's priority, and the package's order (:func:`models.attention.sdpa_order`). Median ms per call.
* ``train`` — one optimizer step of the 124M models (batch 16 x 1024, bf16 autocast, AdamW, clip 1.0): the reference
  (:mod:`benchmarks.lib.reference_gpt`), our MHA / MLA / KVSplice-90 (the ``gpt2`` / ``mla`` / ``mla_kvsplice_90``
  training configs), eager and ``torch.compile``-d, fused AdamW (ours also foreach); with a FlashAttention package
  installed (flash-attn 2 or FlashAttention-4) our MHA runs it and ``ours mha sdpa`` is timed beside it. Median
  of interleaved rounds, CUDA events; MFU = (6·params + 12·L·d·T) · tokens / time / peak bf16 FLOP/s of the device.
* ``decode`` — one token per sequence per step at a fixed context (the step is rolled back), random weights at the
  124M shapes, bf16, caches filled with random values: ours eager and ``+graph``, transformers' GPT2LMHeadModel
  (sdpa attention) with DynamicCache (crop after each step) and StaticCache (``max_cache_len`` = context + 1, the
  step rewrites the same slot). Each step starts on an idle GPU and is timed with CUDA events. For each variant the
  memory-bandwidth floor (cache bytes + weight bytes read once per step / the device's copy bandwidth, measured).
  With triton installed (CUDA builds of torch ship it) our one-token steps run the split-KV kernel
  (``decode_kernel="auto"``, :mod:`models.kernels`); ``benchmarks/serving.py`` times it against SDPA side by side.
"""

from __future__ import annotations

import platform

from benchmarks.harness.header import version
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.runner import Study
from kvsplice.report.tables import cell


def options(p) -> None:
    p.add_argument("--sections", nargs="+", choices=("sdpa", "train", "decode"), default=["sdpa", "train", "decode"])
    p.add_argument("--batch", type=int, nargs="+", help="decode batch sizes")
    p.add_argument("--ctx", type=int, nargs="+", help="decode contexts")
    p.add_argument("--decode-steps", dest="decode_steps", type=int, help="timed decode steps per variant and round")
    p.add_argument("--rounds", type=int, help="interleaved rounds")
    p.add_argument("--train-batch", dest="train_batch", type=int, help="training batch")
    p.add_argument("--train-steps", dest="train_steps", type=int, help="timed training steps per case and round")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile training cases")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' GPT-2 in the decode section")
    p.add_argument("--quick", dest="size", action="store_const", const="quick", default="default",
                   help="tiny shapes and sizes: a smoke run")


def out_stem(args):
    """``results/gpu_<device>[_quick]``: the device's family names the file (CUDA is checked first)."""
    import torch

    from benchmarks.harness.header import device_tag
    from benchmarks.lib.gpu_bench import need_cuda

    need_cuda()
    return RESULTS / f"gpu_{device_tag(torch.cuda.get_device_name())}"


def rows(run):
    import torch

    from benchmarks.lib.gpu_bench import bench_decode, bench_sdpa, bench_train, need_cuda, peak_flops
    from benchmarks.lib.serving_bench import copy_bandwidth
    from models.attention import flash_impl

    need_cuda()
    a, quick = run.args, run.size == "quick"
    torch.backends.cuda.matmul.allow_tf32 = True
    impl = flash_impl()
    bw = copy_bandwidth(torch.device("cuda"), 2**31)  # 2 GiB read + written
    run.notes.update(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                     torch=torch.__version__, cuda=torch.version.cuda, transformers=version("transformers"),
                     python=platform.python_version(), flash_impl=None if impl is None else impl.name,
                     peak_bf16_flops=peak_flops(), bandwidth_gbs=bw / 1e9)
    if "sdpa" in a.sections:
        keys = [256, 1024] if quick else [256, 512, 1024, 2048, 4096, 8192, 16384]
        yield from ({"section": "sdpa", **r} for r in bench_sdpa(keys, 8, 5 if quick else 30))
    if "train" in a.sections:
        yield from ({"section": "train", **r} for r in bench_train(run["train_batch"], 128 if quick else 1024,
                                                                    run["rounds"], run["train_steps"],
                                                                    not a.no_compile, quick))
    if "decode" in a.sections:
        yield from ({"section": "decode", **r} for r in bench_decode(run["batch"], run["ctx"], run["decode_steps"],
                                                                      run["rounds"], quick, bw, not a.no_hf))


def markdown(run, rows) -> str:
    """The three sections' tables from the rows (``section``: sdpa / train / decode) and the run's device facts."""
    report = {**run.notes, **{s: [r for r in rows if r["section"] == s] for s in ("sdpa", "train", "decode")}}
    out = [f"# GPU benchmark — {report['device']}", "",
           f"torch {report['torch']}, CUDA {report['cuda']}, transformers {report.get('transformers')}, "
           f"FlashAttention package: {report['flash_impl'] or 'none (PyTorch SDPA kernels)'}; copy bandwidth "
           f"{report['bandwidth_gbs']:.0f} GB/s.", ""]
    if report.get("sdpa"):
        kernels = list(dict.fromkeys(r["kernel"] for r in report["sdpa"]))
        out += ["## SDPA, one decode call (batch 8, 12 heads, 1 query, head dim 64, bf16), key length growing by one "
                "per call: median ms", "", "| keys | " + " | ".join(kernels) + " |",
                "|---|" + "---|" * len(kernels)]
        for k in dict.fromkeys(r["keys"] for r in report["sdpa"]):
            cells = {r["kernel"]: r["median_ms"] for r in report["sdpa"] if r["keys"] == k}
            out.append(f"| {k:,} | " + " | ".join(cell(cells.get(c)) for c in kernels) + " |")
        out.append("")
    if report.get("train"):
        out += ["## Training step, 124M, batch 16 x 1024, bf16 autocast, clip 1.0 (median ms of interleaved rounds)",
                "", "| model | mode | AdamW | ms/step | tokens/s | MFU | vs reference (same mode) | vs our MHA |",
                "|---|---|---|---|---|---|---|---|"]
        for r in report["train"]:
            out.append(f"| {r['model']} | {r['mode']} | {r['optimizer']} | {r['median_ms']:.1f} | "
                       f"{r['tokens_per_s']:,.0f} | {cell(r['mfu'], '{:.2f}')} | "
                       f"{cell(r['vs_reference_same_mode'], '{:.2f}x')} | {cell(r['vs_ours_mha_same_mode'], '{:.2f}x')} |")
        out.append("")
    if report.get("decode"):
        out += ["## Decode step, 124M shapes, bf16, one token per sequence (median ms; floor = cache + weight bytes "
                "read once / copy bandwidth)", "",
                "| batch | context | variant | ms/step | vs our MHA eager | vs HF StaticCache | floor ms | x floor |",
                "|---|---|---|---|---|---|---|---|"]
        for r in report["decode"]:
            if "median_ms" not in r:
                out.append(f"| {r['batch']} | {r['ctx']:,} | {r['variant']} | {r.get('error', '-')} | | | | |")
                continue
            out.append(f"| {r['batch']} | {r['ctx']:,} | {r['variant']} | {r['median_ms']:.3f} | "
                       f"{cell(r.get('vs_ours_mha'), '{:.2f}x')} | {cell(r.get('vs_hf_static'), '{:.2f}x')} | "
                       f"{r['floor_ms']:.3f} | {r['vs_floor']:.1f} |")
        out.append("")
    return "\n".join(out)


STUDY = Study("gpu", __doc__, rows, options=options, markdown=markdown, summary=lambda run, rows: run.notes,
              out=out_stem, threads=None,
              sizes={"default": {"batch": [8, 64], "ctx": [1024, 4096, 16384], "decode_steps": 10, "rounds": 3,
                                 "train_batch": 16, "train_steps": 5},
                     "quick": {"batch": [2], "ctx": [256], "decode_steps": 3, "rounds": 1, "train_batch": 2,
                               "train_steps": 2}},
              bounds={"batch": (1, 1 << 16), "ctx": (1, 1 << 20), "decode_steps": (1, 10000), "rounds": (1, 1000),
                      "train_batch": (1, 4096), "train_steps": (1, 10000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
