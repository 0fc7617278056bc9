"""Blockwise softmax over chunks ≡ softmax over the concatenated logits (extreme logits, -inf, fp32/fp16/bf16)."""

import pytest
import torch

from kvsplice.online.blockwise import (Chunk, blockwise_attention, chunk_state, finalize, init_state, merge, update)

LENGTHS = (1, 5, 1, 17, 3, 9)




def reference(logits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(logits (..., Tq, T)) @ values (..., T, r) in float64."""
    return torch.softmax(logits.double(), -1) @ values.double()


def extreme_logits(shape, gen, dtype) -> torch.Tensor:
    """Logits spread over ±1e4 (so most weights underflow) plus near-ties at the max, in ``dtype``."""
    base = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * 1e4
    ties = 1e4 - torch.rand(shape, generator=gen, dtype=torch.float64) * 4  # a few near the top
    pick = torch.rand(shape, generator=gen) < 0.15
    return torch.where(pick, ties, base).to(dtype)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("magnitude", ["normal", "extreme"])
def test_update_equals_softmax_over_concatenation(dtype, atol, magnitude):
    gen = torch.Generator().manual_seed(0)
    n = sum(LENGTHS)
    shape = (2, 3, 4, n)  # (B, H, Tq, T)
    logits = (extreme_logits(shape, gen, dtype) if magnitude == "extreme"
              else (torch.randn(shape, generator=gen) * 3).to(dtype))
    values = torch.randn(2, 3, n, 6, generator=gen).to(dtype)
    state = init_state((2, 3, 4), 6)
    for lg, v in zip(logits.split(LENGTHS, -1), values.split(LENGTHS, -2)):
        state = update(state, lg, v)
    out = finalize(state)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    ref = reference(logits, values)  # the same (rounded) inputs, exact softmax
    torch.testing.assert_close(out.double(), ref, atol=atol if dtype != torch.float32 else 1e-6, rtol=0)
    if dtype == torch.float32:
        assert (out.double() - ref).abs().max().item() <= 1e-6


def test_per_query_values_layout_and_merge_order():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 12, generator=gen, dtype=torch.float64) * 50
    values = torch.randn(5, 12, 3, generator=gen, dtype=torch.float64)  # one value set per query
    parts = [chunk_state(l, v) for l, v in zip(logits.split([4, 1, 7], -1), values.split([4, 1, 7], -2))]
    ref = (torch.softmax(logits, -1)[..., None] * values).sum(-2)
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        st = init_state((5,), 3, dtype=torch.float64)
        for i in order:
            st = merge(st, parts[i])
        torch.testing.assert_close(finalize(st), ref, atol=1e-12, rtol=0)


def test_minus_inf_safe():
    logits = torch.tensor([[float("-inf"), float("-inf"), 2.0, float("-inf"), -1e4, 1e4],
                           [float("-inf")] * 6,
                           [0.0, float("-inf"), float("-inf"), float("-inf"), float("-inf"), float("-inf")]])
    values = torch.arange(18.0).view(6, 3)
    st = init_state((3,), 3)
    for lg, v in zip(logits.split([2, 1, 3], -1), values.split([2, 1, 3], -2)):  # chunk 0 fully masked for row 0
        st = update(st, lg, v)
    out = finalize(st)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], values[5])  # 1e4 dominates
    torch.testing.assert_close(out[1], torch.zeros(3))  # nothing visible → 0
    torch.testing.assert_close(out[2], values[0])


def random_chunks(gen, lead, lengths, d, dv, ranks, dtype, shared_e=None, identity_first=True):
    """Chunks with their own orthonormal bases (first one identity), and the naive concatenated K̂, V̂."""
    chunks, k_hat, v_hat = [], [], []
    for j, n in enumerate(lengths):
        k = torch.randn(*lead, n, d, generator=gen)
        v = torch.randn(*lead, n, dv, generator=gen)
        if j == 0 and identity_first:
            bk, be = None, None
            a, b = k, v
        else:
            rk, rv = ranks
            bk = torch.linalg.qr(torch.randn(*lead, d, rk, generator=gen))[0]
            be = shared_e if shared_e is not None else torch.linalg.qr(torch.randn(*lead, dv, rv, generator=gen))[0]
            a, b = k @ bk, v @ be
        a, b = a.to(dtype), b.to(dtype)
        bk = bk.to(dtype) if bk is not None else None
        be_d = be.to(dtype) if be is not None else None
        chunks.append(Chunk(a, b, bk, be_d))
        k_hat.append(a.double() @ bk.double().transpose(-1, -2) if bk is not None else a.double())
        v_hat.append(b.double() @ be_d.double().transpose(-1, -2) if be is not None else b.double())
    if shared_e is not None:  # the same object in every non-identity chunk, so it is reconstructed once
        e = chunks[-1].value_basis
        for c in chunks:
            if c.value_basis is not None:
                c.value_basis = e
    return chunks, torch.cat(k_hat, -2), torch.cat(v_hat, -2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
def test_blockwise_attention_equals_naive_over_reconstructed(dtype, shared):
    gen = torch.Generator().manual_seed(2)
    lead, d, dv, tq = (2, 3), 8, 6, 3
    shared_e = torch.linalg.qr(torch.randn(*lead, dv, 4, generator=gen))[0] if shared else None
    chunks, k_hat, v_hat = random_chunks(gen, lead, LENGTHS, d, dv, (5, 4), dtype, shared_e)
    q = (torch.randn(*lead, tq, d, generator=gen) * 4).to(dtype)
    scale = 0.35
    out = blockwise_attention(q, chunks, scale=scale)
    assert out.dtype == dtype and out.shape == (*lead, tq, dv)
    ref = reference(scale * q.double() @ k_hat.transpose(-1, -2), v_hat)
    atol = {torch.float32: 1e-6, torch.float16: 3e-3, torch.bfloat16: 3e-2}[dtype]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)
    out32 = blockwise_attention(q, chunks, scale=scale, out_dtype=torch.float32)
    torch.testing.assert_close(out32.double(), ref, atol=1e-6 if dtype == torch.float32 else 1e-5, rtol=0)  # fp32 math


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_blockwise_attention_extreme_logits_and_masks(dtype):
    """Logits past ±1e3 formed through the per-chunk query projection, with a bottom-right causal mask."""
    gen = torch.Generator().manual_seed(5)
    chunks, _, _ = random_chunks(gen, (2,), LENGTHS, 4, 3, (4, 3), torch.float32)
    t, tq = sum(LENGTHS), 5
    q = (torch.randn(2, tq, 4, generator=gen) * 3e2).to(dtype)
    for c in chunks:
        c.keys, c.values = (c.keys * 10).to(dtype), c.values.to(dtype)
    full_mask = causal_mask_bottom_right(tq, t)
    start = 0
    for c, n in zip(chunks, LENGTHS):
        c.mask = full_mask[:, start : start + n]
        start += n
    out = blockwise_attention(q, chunks, scale=1.0, out_dtype=torch.float32)

    def rebuild(x, basis):  # the stored (rounded) numbers, reconstructed in float64
        return x.double() if basis is None else x.double() @ basis.double().transpose(-1, -2)

    k_hat = torch.cat([rebuild(c.keys, c.key_basis) for c in chunks], -2)
    v_hat = torch.cat([rebuild(c.values, c.value_basis) for c in chunks], -2)
    logits = q.double() @ k_hat.transpose(-1, -2)
    assert logits.abs().max() > 1e3
    ref = reference(logits.masked_fill(~full_mask, float("-inf")), v_hat)
    assert torch.isfinite(out).all()
    # fp16 inputs: logits are formed in fp32 from the fp16 numbers, so the result matches their exact softmax
    torch.testing.assert_close(out.double(), ref, atol=1e-5 if dtype == torch.float32 else 1e-3, rtol=0)


def causal_mask_bottom_right(tq: int, t: int) -> torch.Tensor:
    """(Tq, T): query i sits at position T − Tq + i."""
    return torch.arange(t)[None, :] <= torch.arange(t - tq, t)[:, None]


def test_requires_chunks():
    with pytest.raises(ValueError):
        blockwise_attention(torch.zeros(1, 2), [], scale=1.0)
