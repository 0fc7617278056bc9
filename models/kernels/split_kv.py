"""The split-KV decode kernel (flash-decoding) in Triton: one new query token per sequence, ``H`` query heads over a
cached row stream shared by a group of heads, the keys split across programs and merged by log-sum-exp.

Imported only where ``triton`` is installed (:mod:`models.kernels` checks); on a CPU tensor it runs under Triton's
interpreter (``TRITON_INTERPRET=1`` set before this module is imported).

Layouts (any strides; the time axis need not be contiguous, so a cache's whole storage is passed as it is):

* ``q (B, Hq, Dk)``: the one query of each head (scores use ``q·k·scale``);
* ``k (B, Hkv, T, Dk)``, ``v (B, Hkv, T, Dv)``: the rows; query head ``h`` reads stream ``h // (Hq // Hkv)``
  (MQA / absorbed MLA / a KVSplice latent: ``Hkv = 1``; GQA: one per KV head; low-rank coefficients: ``Dk = R_k``,
  ``Dv = R_v``). ``k`` and ``v`` may be the same tensor (a latent is both key and value: read once);
* int8 rows: ``k``/``v`` int8 with per-row scales ``(B, Hkv, T)`` (:func:`models.quant.quantize_int8`'s format,
  ``row · scale``), dequantised in registers;
* ``bias (B|1, Hkv|1, T)``, optional: added to every score of a key (per-token log-weights; ``-inf`` masks a key);
* ``lengths (B|1,)`` int, optional: keys ``>= lengths[b]`` are never read (a fixed-capacity cache: one CUDA graph
  serves every step, the length lives on the device); default every key.

Stage 1, grid ``(B·Hkv, head blocks, splits)``: a program holds the ``BLOCK_H`` query heads of a stream (padded to
16 for ``tl.dot``), walks its split of the keys in blocks of ``BLOCK_N`` rows with the online softmax, and writes
``acc / l`` and ``lse = m + log l`` (base 2) — with one split, the output itself. Row sizes are padded to the next power of two in registers (masked
loads), never in memory. Stage 2, grid ``(B, Hq)``: merges the splits by log-sum-exp. A query that sees no key gets
zeros (as the eager path).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MIN_BLOCK = 16
"""``tl.dot`` needs every dimension >= 16 once compiled (the interpreter does not check; we respect it anyway)."""
TILE_ELEMENTS = 4096
"""Keys x row numbers of one stage-1 tile (see :func:`block_sizes`)."""
MAX_SPLITS = 64
KEYS_PER_SPLIT_MIN = 256
"""A split walks at least this many keys (a short split costs more in its launch and merge than it saves)."""


@triton.jit
def _split_kv_stage1(Q, K, V, KS, VS, BIAS, LENS, MID_O, MID_LSE,
                     sm_scale, n_keys, num_splits,
                     s_qb, s_qh, s_qd,
                     s_kb, s_kh, s_kt, s_kd,
                     s_vb, s_vh, s_vt, s_vd,
                     s_ksb, s_ksh, s_kst,
                     s_vsb, s_vsh, s_vst,
                     s_bb, s_bh, s_bt,
                     s_lb,
                     s_ob, s_oh, s_os, s_od,
                     s_lsb, s_lsh, s_lss,
                     H_KV: tl.constexpr, GROUP: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                     DIRECT: tl.constexpr, INT8: tl.constexpr, SHARED_KV: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_LENS: tl.constexpr, IEEE: tl.constexpr):
    pid_bk = tl.program_id(0)  # b * H_KV + kv
    pid_h = tl.program_id(1)  # block of query heads within the group
    split = tl.program_id(2)
    b = (pid_bk // H_KV).to(tl.int64)  # 64-bit offsets: one layer of a large batch passes 2^31 elements
    kv = pid_bk % H_KV
    if HAS_LENS:
        length = tl.load(LENS + b * s_lb).to(tl.int32)
        length = tl.minimum(length, n_keys)
    else:
        length = n_keys
    # this split's keys: an equal share of the sequence's own length, rounded up to whole blocks
    per_split = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    offs_g = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # head within the group
    h_ok = offs_g < GROUP
    heads = kv * GROUP + offs_g  # query heads
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dk_ok = offs_dk < D_K
    dv_ok = offs_dv < D_V
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_dk[None, :] * s_qd,
                mask=h_ok[:, None] & dk_ok[None, :], other=0.0)  # (BLOCK_H, BLOCK_DK)
    qk_scale = sm_scale * 1.4426950408889634  # scores in base 2

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    k_base = K + b * s_kb + kv * s_kh
    v_base = V + b * s_vb + kv * s_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        k = tl.load(k_base + offs_n[:, None] * s_kt + offs_dk[None, :] * s_kd,
                    mask=n_ok[:, None] & dk_ok[None, :], other=0)  # (BLOCK_N, BLOCK_DK)
        if INT8:
            ks = tl.load(KS + b * s_ksb + kv * s_ksh + offs_n * s_kst, mask=n_ok, other=0.0)
            k = (k.to(tl.float32) * ks.to(tl.float32)[:, None]).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # (BLOCK_H, BLOCK_N)
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        if HAS_BIAS:
            bias = tl.load(BIAS + b * s_bb + kv * s_bh + offs_n * s_bt, mask=n_ok, other=0.0)
            s = s + bias.to(tl.float32)[None, :] * 1.4426950408889634
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every key so far masked: no NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if SHARED_KV:
            vv = k  # a latent is its own value: BLOCK_DV == BLOCK_DK
        else:
            vv = tl.load(v_base + offs_n[:, None] * s_vt + offs_dv[None, :] * s_vd,
                         mask=n_ok[:, None] & dv_ok[None, :], other=0)  # (BLOCK_N, BLOCK_DV)
            if INT8:
                vs = tl.load(VS + b * s_vsb + kv * s_vsh + offs_n * s_vst, mask=n_ok, other=0.0)
                vv = (vv.to(tl.float32) * vs.to(tl.float32)[:, None]).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m_i = m_new
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(MID_O + b * s_ob + heads[:, None] * s_oh + split * s_os + offs_dv[None, :] * s_od,
             out.to(MID_O.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])
    if not DIRECT:  # DIRECT (one split): MID_O is the output itself and there is nothing to merge
        tl.store(MID_LSE + b * s_lsb + heads * s_lsh + split * s_lss, lse, mask=h_ok)


@triton.jit
def _split_kv_stage2(MID_O, MID_LSE, OUT, num_splits,
                     s_ob, s_oh, s_os, s_od,
                     s_lsb, s_lsh, s_lss,
                     s_yb, s_yh, s_yd,
                     D_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D_V
    lse_base = MID_LSE + b * s_lsb + h * s_lsh
    lse = tl.load(lse_base + offs_s * s_lss, mask=offs_s < num_splits, other=float("-inf"))  # (BLOCK_S,)
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse - m_safe), 0)  # an empty split weighs 0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for split in range(0, num_splits):  # one row of the splits at a time: no (splits x Dv) tile
        w = tl.exp2(tl.load(lse_base + split * s_lss) - m_safe)
        acc += w * tl.load(MID_O + b * s_ob + h * s_oh + split * s_os + offs_d * s_od, mask=d_ok, other=0.0)
    y = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + b * s_yb + h * s_yh + offs_d * s_yd, y.to(OUT.dtype.element_ty), mask=d_ok)


def _pow2(n: int, least: int = MIN_BLOCK) -> int:
    return max(least, triton.next_power_of_2(int(n)))


@lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (asked once per device)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def block_sizes(group: int, d_k: int, d_v: int, shared: bool) -> dict[str, int]:
    """Stage 1's tile sizes: ``BLOCK_H`` query heads (>= 16, at most 64 per program), rows padded to powers of two
    (>= 16; a shared latent's value tile is its key tile), ``BLOCK_N`` keys per block: a row tile of at most
    :data:`TILE_ELEMENTS` (64 keys of <= 64 numbers, 32 of 128, 16 of 256), so no case spills registers (the
    compiled register counts: tests/split_kv_aot.py)."""
    bdk = _pow2(d_k)
    bdv = bdk if shared else _pow2(d_v)
    block_n = max(MIN_BLOCK, min(64, TILE_ELEMENTS // max(bdk, bdv)))
    return dict(BLOCK_H=_pow2(min(group, 64)), BLOCK_N=block_n, BLOCK_DK=bdk, BLOCK_DV=bdv)


def choose_splits(n_keys: int, programs: int, sms: int, block_n: int) -> int:
    """Splits of the keys: enough programs for ~4 per SM (``programs`` = batch · streams · head blocks without a
    split), each split at least :data:`KEYS_PER_SPLIT_MIN` keys, at most :data:`MAX_SPLITS`. ``n_keys`` is the
    row count of the stream (a fixed-capacity cache's capacity: fixed, so one CUDA graph serves every step). The
    count is a runtime argument of both kernels (only "one split or more" is compiled in), so an eager decode
    whose keys grow step by step compiles no new variant as the count changes."""
    want = math.ceil(4 * sms / max(programs, 1))
    by_len = max(1, n_keys // max(KEYS_PER_SPLIT_MIN, block_n))
    return int(max(1, min(want, by_len, MAX_SPLITS)))


def split_kv_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                    bias: Optional[torch.Tensor] = None, lengths: Optional[torch.Tensor] = None,
                    num_splits: Optional[int] = None, block_n: Optional[int] = None) -> torch.Tensor:
    """``softmax(q·kᵀ·scale + bias)·v`` of one query per head over the first ``lengths[b]`` rows → ``(B, Hq, Dv)``
    at ``q``'s dtype. Layouts: the module docstring. ``num_splits`` / ``block_n`` override the choice (tests)."""
    bsz, hq, d_k = q.shape
    _, hkv, n_keys, d_v = v.shape
    if k.shape[:3] != (bsz, hkv, n_keys) or k.shape[3] != d_k or hq % hkv:
        raise ValueError(f"split_kv_decode: bad shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    int8 = k.dtype == torch.int8
    if int8 != (v.dtype == torch.int8) or int8 != (k_scale is not None) or int8 != (v_scale is not None):
        raise ValueError("split_kv_decode: int8 rows need int8 k and v and both per-row scales")
    group = hq // hkv
    shared = (k is v) or (k.data_ptr() == v.data_ptr() and k.stride() == v.stride() and k.shape == v.shape
                           and k_scale is v_scale)
    blocks = block_sizes(group, d_k, d_v, shared)
    block_h, bdk, bdv = blocks["BLOCK_H"], blocks["BLOCK_DK"], blocks["BLOCK_DV"]
    block_n = blocks["BLOCK_N"] if block_n is None else block_n
    head_blocks = triton.cdiv(group, block_h)
    if num_splits is None:  # a runtime argument: a new count compiles nothing new
        sms = sm_count(q.device.index or 0) if q.device.type == "cuda" else 4
        num_splits = choose_splits(n_keys, bsz * hkv * head_blocks, sms, block_n)
    dev = q.device
    out = torch.empty(bsz, hq, d_v, dtype=q.dtype, device=dev)
    if num_splits == 1:  # stage 1 writes the output: no merge (one launch)
        mid_o, mid_lse = out[:, :, None], torch.empty(1, 1, 1, dtype=torch.float32, device=dev)
    else:
        mid_o = torch.empty(bsz, hq, num_splits, d_v, dtype=torch.float32, device=dev)
        mid_lse = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=dev)
    dummy = mid_lse  # an unused pointer argument (its constexpr switch is off)
    ks = k_scale.reshape(k_scale.shape[:3]) if int8 else dummy
    vs = v_scale.reshape(v_scale.shape[:3]) if int8 else dummy
    ks_st = tuple(ks.stride()) if int8 else (0, 0, 0)
    vs_st = tuple(vs.stride()) if int8 else (0, 0, 0)
    if bias is not None:
        if bias.dim() != 3 or bias.shape[-1] != n_keys:
            raise ValueError(f"split_kv_decode: bias must be (B|1, Hkv|1, {n_keys}), got {tuple(bias.shape)}")
        b_st = tuple(0 if bias.shape[i] == 1 else bias.stride(i) for i in range(3))
    else:
        b_st = (0, 0, 0)
    if lengths is not None:
        lengths = lengths.reshape(-1)
        l_st = 0 if lengths.numel() == 1 else lengths.stride(0)
    _split_kv_stage1[(bsz * hkv, head_blocks, num_splits)](
        q, k, v, ks, vs, bias if bias is not None else dummy, lengths if lengths is not None else dummy,
        mid_o, mid_lse, float(scale), n_keys, num_splits,
        *q.stride(), *k.stride(), *v.stride(), *ks_st, *vs_st, *b_st, l_st if lengths is not None else 0,
        *mid_o.stride(), *mid_lse.stride(),
        H_KV=hkv, GROUP=group, D_K=d_k, D_V=d_v, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_DK=bdk, BLOCK_DV=bdv,
        DIRECT=num_splits == 1, INT8=int8, SHARED_KV=shared, HAS_BIAS=bias is not None,
        HAS_LENS=lengths is not None, IEEE=q.dtype == torch.float32)
    if num_splits == 1:
        return out
    _split_kv_stage2[(bsz, hq)](
        mid_o, mid_lse, out, num_splits, *mid_o.stride(), *mid_lse.stride(), *out.stride(),
        D_V=d_v, BLOCK_DV=_pow2(d_v), BLOCK_S=MAX_SPLITS)
    return out
