"""Absorbed-MLA decode attention over the one shared latent head (12 query heads folded into query rows, one key
head): which formulation is fast on this GPU? SDPA's default, three ops, each fused kernel on the latent zero-padded
to a multiple of 8, a split over the keys. Median ms per call (CUDA events), a row per
(batch, context, rank). Needs CUDA.

    python -m benchmarks.latent_sdpa
    python -m benchmarks.latent_sdpa --smoke         # one case, quickly
"""

from __future__ import annotations

from benchmarks.harness.runner import Study

HEADS, HEAD_DIM = 12, 64  # GPT-2 small's query heads and head size (the softmax scale)


def formulations(q, s, scale: float, splits: int = 16) -> dict:
    """``name -> call`` of the latent attention ``softmax(q s^T * scale) s``: ``q (B, 1, H, r)`` query rows over the
    shared latent ``s (B, 1, T, r)``."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

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
        mx = m.amax(1, keepdim=True)
        w = torch.exp(m - mx)
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


def options(p) -> None:
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes")
    p.add_argument("--ctx", type=int, nargs="+", help="cached tokens")
    p.add_argument("--ranks", type=int, nargs="+", help="latent sizes r")
    p.add_argument("--calls", type=int, help="timed calls per formulation (after 5 untimed)")


def rows(run):
    import torch

    from benchmarks.lib.gpu_bench import need_cuda

    need_cuda()
    dt = torch.bfloat16
    for b in run["batch"]:
        for t in run["ctx"]:
            for r in run["ranks"]:
                q = torch.randn(b, 1, HEADS, r, device="cuda", dtype=dt)
                s = torch.randn(b, 1, t, r, device="cuda", dtype=dt)
                res = {}
                for name, fn in formulations(q, s, HEAD_DIM ** -0.5).items():
                    try:
                        res[name] = run.time(fn, run["calls"], warmup=5, clock="cuda")
                    except RuntimeError:  # a kernel that cannot take these inputs
                        res[name] = float("nan")
                run.say(f"B={b} T={t} r={r}: " + ", ".join(f"{k} {v:.4f}" for k, v in res.items()))
                yield {"batch": b, "ctx": t, "rank": r, "ms": res}


STUDY = Study("latent_sdpa", __doc__, rows, options=options, threads=None,
              sizes={"default": {"batch": [8, 64], "ctx": [1024, 4096, 16384], "ranks": [26, 128], "calls": 50},
                     "smoke": {"batch": [8], "ctx": [1024], "ranks": [26], "calls": 10}},
              bounds={"batch": (1, 4096), "ctx": (16, 1 << 20), "ranks": (1, 1024), "calls": (1, 10000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
