"""Absorbed-MLA decode attention over the one shared latent head (12 query heads folded into query rows, one key
head): which formulation is fast on this GPU? SDPA's default, three ops, each fused kernel on the latent zero-padded
to a multiple of 8, a split over the keys. Median ms per call (CUDA events). Needs CUDA.

    python benchmarks/latent_sdpa.py
"""
import torch, torch.nn.functional as F, statistics
from torch.nn.attention import SDPBackend, sdpa_kernel
dev = "cuda"; dt = torch.bfloat16
def timeit(fn, n=50):
    for _ in range(5): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
for B in (8, 64):
  for T in (1024, 4096, 16384):
    for r in (26, 128):
      H = 12; scale = 64 ** -0.5
      q = torch.randn(B, 1, H, r, device=dev, dtype=dt); s = torch.randn(B, 1, T, r, device=dev, dtype=dt)
      res = {}
      res["sdpa default"] = timeit(lambda: F.scaled_dot_product_attention(q, s, s, scale=scale))
      def three():
          a = (q @ s.transpose(-1, -2)) * scale
          return torch.softmax(a, -1, dtype=torch.float32).to(dt) @ s
      res["3-op"] = timeit(three)
      def three_flat():  # (B, H, r) @ (B, r, T): one bmm per batch
          a = torch.bmm(q[:, 0], s[:, 0].transpose(1, 2)) * scale
          return torch.bmm(torch.softmax(a.float(), -1).to(dt), s[:, 0])
      res["3-op bmm"] = timeit(three_flat)
      rp = (r + 7) // 8 * 8
      if rp != r:
          qp = F.pad(q, (0, rp - r)); sp = F.pad(s, (0, rp - r))
      else:
          qp, sp = q, s
      for name, be in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
          try:
              with sdpa_kernel([be]):
                  res[f"{name} pad{rp}"] = timeit(lambda: F.scaled_dot_product_attention(qp, sp, sp, scale=scale))
          except RuntimeError:  # a kernel that cannot take these inputs
              res[f"{name} pad{rp}"] = float('nan')
      # split-K: chunks of keys as batch, combine with logsumexp
      def splitk(chunks=16):
          c = T // chunks
          sc = s[:, 0].reshape(B, chunks, c, r)  # (B, C, c, r)
          a = torch.einsum("bhr,bkcr->bkhc", q[:, 0], sc).float() * scale  # (B, C, H, c)
          m = a.amax(-1, keepdim=True); p = torch.exp(a - m); l = p.sum(-1, keepdim=True)
          o = torch.einsum("bkhc,bkcr->bkhr", p.to(dt), sc).float()  # (B, C, H, r)
          M = m.amax(1, keepdim=True); w = torch.exp(m - M)
          return ((o * w).sum(1) / (l * w).sum(1)).to(dt)
      res["split-k 16"] = timeit(splitk)
      print(f"B={B} T={T} r={r}: " + ", ".join(f"{k} {v:.4f}" for k, v in res.items()), flush=True)
