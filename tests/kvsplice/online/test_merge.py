"""The amortised merge of a chunked stream (:mod:`kvsplice.online.merge`): which chunks merge, and the merged chunk
on new bases — exact when they span the old ones, inside its residual bound when they do not."""

import torch

from kvsplice.online.chunks import StoredChunk
from kvsplice.online.merge import merge_chunks, oldest_to_merge

D, R = 6, 2


def _orthonormal(d: int, r: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, r, generator=torch.Generator().manual_seed(seed)))[0]  # (d, r)


def _chunk(start: int, n: int, bk: torch.Tensor, be: torch.Tensor, seed: int, warmup: bool = False) -> StoredChunk:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, bk.shape[1], generator=g), torch.randn(n, be.shape[1], generator=g)  # (n, r) each
    return StoredChunk(a, b, bk, be, start, torch.tensor(0.1), torch.tensor(0.2), warmup)


def test_the_oldest_half_merges_past_the_cap_and_never_the_warmup_chunk():
    e = _orthonormal(D, R, 0)
    plain = [_chunk(i, 1, e, e, i) for i in range(5)]
    assert oldest_to_merge(plain, 5) is None and oldest_to_merge(plain, 4) == slice(0, 4)  # ⌊4/2⌋ + 2 chunks
    warm = [_chunk(0, 1, e, e, 9, warmup=True)] + plain
    assert oldest_to_merge(warm, 5) is None and oldest_to_merge(warm, 3) == slice(1, 4)  # ⌊3/2⌋ + 2, after it


def test_new_bases_spanning_the_old_ones_merge_exactly():
    b1, b2, e = _orthonormal(D, R, 1), _orthonormal(D, R, 2), _orthonormal(D, R, 3)
    old = [_chunk(4, 3, b1, e, 4), _chunk(7, 2, b2, e, 5)]
    both = torch.linalg.qr(torch.cat([b1, b2], 1))[0]  # (D, 2R): spans both chunks' key bases
    m = merge_chunks(old, both, e, torch.float32)
    assert (m.start, m.n) == (4, 5) and m.b.shape == (5, R)
    rebuilt = torch.cat([c.a @ c.bk.T for c in old])  # (5, D): the stored keys
    assert torch.allclose(m.a @ both.T, rebuilt, atol=1e-5)
    assert torch.allclose(m.b, torch.cat([c.b for c in old]))  # the value basis is shared: values kept as they are
    assert abs(float(m.res_k) - 0.1) < 1e-5 and float(m.res_v) == float(torch.tensor(0.2))  # the bounds kept


def test_a_narrower_basis_adds_its_reprojection_error_to_the_bound():
    b1, e = _orthonormal(D, R, 6), _orthonormal(D, R, 7)
    old = [_chunk(0, 4, b1, e, 8)]
    narrow = b1[:, :1]  # (D, 1): half of the old key basis
    m = merge_chunks(old, narrow, _orthonormal(D, R, 10), torch.float32)
    rebuilt = old[0].a @ b1.T  # (4, D)
    lost = (rebuilt - m.a @ narrow.T).norm(dim=-1).amax()
    assert float(lost) > 0.1 and abs(float(m.res_k) - (0.1 + float(lost))) < 1e-5
    assert float(m.res_v) > 0.21  # the values re-projected onto another basis lose some too
