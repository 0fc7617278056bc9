"""Compile the split-KV kernels ahead of time for CUDA targets, without a GPU (Triton's bundled ptxas), and print one
line per case: ``OK <case> regs=<n> local=<bytes>``. Run by tests/models/test_decode_kernel.py in a subprocess with
``TRITON_INTERPRET=0`` (the kernels must be compiled functions, not the interpreter's): the interpreter checks no
``tl.dot`` size rule and no type rule of the compiler; this does.

    python tests/split_kv_aot.py 90 80
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile  # noqa: E402

from models.kernels.split_kv import MAX_SPLITS, _split_kv_stage1, _split_kv_stage2, block_sizes  # noqa: E402

# (row dtype, query dtype, group, Dk, Dv, shared latent, bias, lengths, splits): the shapes the paths launch
CASES = [
    ("bf16", "bf16", 12, 26, 26, True, False, True, 8),  # KVSplice-90 latent, CUDA-graph step (device length)
    ("i8", "fp16", 12, 77, 77, True, False, True, 8),  # KVSplice-70 latent, int8 rows
    ("bf16", "bf16", 12, 256, 256, True, False, False, 1),  # MLA latent, one split: stage 1 writes the output
    ("i8", "fp16", 3, 24, 40, False, True, False, 8),  # low-rank coefficients R_k != R_v, int8, log-weights
    ("fp32", "fp32", 1, 64, 64, False, True, True, 8),  # MHA rows, fp32 (IEEE dots)
    ("bf16", "bf16", 12, 26, 26, True, False, False, 1, ("n_keys", "s_qd", "s_kd", "s_vd")),  # one key held
]


def stage1(row: str, qdt: str, group: int, d_k: int, d_v: int, shared: bool, bias: bool, lens: bool,
           splits: int, specialized: tuple[str, ...] = ()) -> ASTSource:
    """Stage 1 for one case; ``specialized``: integer arguments Triton turns into the constant 1 when they are 1 at
    launch (one key, unit strides)."""
    ptr = {"Q": qdt, "K": row, "V": row, "KS": "fp16", "VS": "fp16", "BIAS": "fp32", "LENS": "i32",
           "MID_O": "fp32" if splits > 1 else qdt, "MID_LSE": "fp32"}
    sig = {}
    for name in _split_kv_stage1.arg_names:
        if name in ptr:
            sig[name] = "*" + ptr[name]
        elif name == "sm_scale":
            sig[name] = "fp32"
        elif name in specialized:
            sig[name] = "constexpr"
        elif name.startswith("s_") or name in ("n_keys", "num_splits"):
            sig[name] = "i32"
        else:
            sig[name] = "constexpr"
    const = dict(H_KV=2, GROUP=group, D_K=d_k, D_V=d_v, DIRECT=splits == 1, INT8=row == "i8", SHARED_KV=shared,
                 HAS_BIAS=bias, HAS_LENS=lens, IEEE=qdt == "fp32", **block_sizes(group, d_k, d_v, shared),
                 **{name: 1 for name in specialized})
    return ASTSource(fn=_split_kv_stage1, signature=sig, constexprs=const)


def stage2(d_v: int) -> ASTSource:
    sig = {n: ("*fp32" if n in ("MID_O", "MID_LSE") else "*bf16" if n == "OUT" else
               "i32" if n.startswith("s_") or n == "num_splits" else "constexpr") for n in _split_kv_stage2.arg_names}
    const = dict(D_V=d_v, BLOCK_DV=max(16, 1 << (d_v - 1).bit_length()), BLOCK_S=MAX_SPLITS)
    return ASTSource(fn=_split_kv_stage2, signature=sig, constexprs=const)


def usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local memory bytes: spills) of a cubin, by the cuobjdump bundled with Triton."""
    tool = Path(sys.modules["triton"].__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*LOCAL:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


def main(archs: list[int]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("split_kv_aot.py: error: run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for i, case in enumerate(CASES if arch == archs[0] else CASES[:1]):
            k = triton_compile(stage1(*case), target=target)
            regs, local = usage(k.asm["cubin"])
            print(f"OK sm_{arch} stage1 case {i} regs={regs} local={local}", flush=True)
        k = triton_compile(stage2(256), target=target)
        print(f"OK sm_{arch} stage2 regs={usage(k.asm['cubin'])[0]} local={usage(k.asm['cubin'])[1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90]))
