"""The split-KV decode kernel (models.kernels) against the eager attention (models.attention.attend): every row
size, groupings (MHA / GQA / MQA-MLA), ragged lengths, the fixed-capacity view's mask, log-weights, int8 rows and
1 / many splits. On CPU through Triton's interpreter (tests/conftest.py turns it on); on CUDA compiled (gpu marker)."""

import pytest
import torch

from models.attention import attend
from models.quant import dequantize_int8 as dequantize, quantize_int8
from models.kernels import (decode_attend, interpreting, resolve_decode_kernel, triton_missing_reason,
                            use_decode_kernel)
from models.static_cache import StaticCacheView
from models.stream_cache import DecodeCache

pytestmark = pytest.mark.skipif(triton_missing_reason() is not None, reason=str(triton_missing_reason()))

# CPU tensors run through Triton's interpreter only (tests/conftest.py turns it on where there is no CUDA); on a
# CUDA machine the kernels are compiled and the CUDA cases run.
DEVICES = (["cpu"] if interpreting() else []) + (["cuda"] if torch.cuda.is_available() else [])
SIZES = [(26, 26), (77, 77), (128, 128), (256, 256), (64, 64), (24, 40)]  # (Dk, Dv): latents, MHA rows, R_k != R_v
GROUPS = [(12, 1), (8, 2), (4, 4)]  # (Hq, Hkv): absorbed MLA / MQA, GQA, MHA


def _dev(device):
    if device == "cuda":
        return pytest.param(device, marks=pytest.mark.gpu)
    return device


def _rows(b, hq, hkv, t, dk, dv, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype=dtype, device=device)  # noqa: E731
    return mk(b, hq, 1, dk), mk(b, hkv, t, dk), mk(b, hkv, t, dv)


def _eager(q, k, v, scale, bias=None):
    """The eager reference in fp32: attend over every row (bias masks / weights)."""
    return attend(q.float(), k.float(), v.float(), scale=scale, backend="sdpa",
                  bias=None if bias is None else bias.float())


@pytest.mark.parametrize("device", [_dev(d) for d in DEVICES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dk,dv", SIZES)
def test_kernel_matches_eager_for_every_row_size(device, dtype, dk, dv):
    hq, hkv = GROUPS[(dk + dv) % 3]  # each size meets a grouping; the groupings are all covered below too
    q, k, v = _rows(2, hq, hkv, 45, dk, dv, dtype, device)  # 45 keys: no multiple of any block
    y = decode_attend(q, k, v, scale=dk ** -0.5, num_splits=3)
    assert y.shape == (2, hq, 1, dv) and y.dtype == dtype
    torch.testing.assert_close(y.float(), _eager(q, k, v, dk ** -0.5), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device", [_dev(d) for d in DEVICES])
@pytest.mark.parametrize("hq,hkv", GROUPS)
@pytest.mark.parametrize("splits", [1, 5])
def test_kernel_splits_merge_to_the_same_result(device, hq, hkv, splits):
    q, k, v = _rows(3, hq, hkv, 70, 32, 32, torch.float32, device, seed=1)
    y = decode_attend(q, k, v, scale=0.2, num_splits=splits)
    torch.testing.assert_close(y, _eager(q, k, v, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", [_dev(d) for d in DEVICES])
def test_kernel_over_a_single_key(device):
    """The first decode step after a one-token prompt: one key, the output is its value."""
    q, k, v = _rows(2, 12, 1, 1, 26, 26, torch.float32, device, seed=6)
    torch.testing.assert_close(decode_attend(q, k, v, scale=0.2), v.expand(2, 12, 1, 26), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", [_dev(d) for d in DEVICES])
def test_kernel_reads_only_each_sequences_length(device):
    """Ragged lengths in one batch (a device tensor): rows past a sequence's length are never read, so NaN there
    changes nothing; each sequence equals attention over its own rows."""
    q, k, v = _rows(3, 8, 2, 60, 26, 26, torch.float32, device, seed=2)
    lengths = torch.tensor([60, 17, 1], device=device)
    k2, v2 = k.clone(), v.clone()
    for i, n in enumerate(lengths.tolist()):
        k2[i, :, n:], v2[i, :, n:] = float("nan"), float("nan")
    y = decode_attend(q, k2, v2, scale=0.3, lengths=lengths, num_splits=4)
    for i, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(y[i:i + 1], _eager(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], 0.3),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", [_dev(d) for d in DEVICES])
def test_kernel_takes_the_fixed_capacity_views_mask_or_length(device):
    """Over a StaticCacheView's whole storage: its -inf key bias and its device length give the step over the rows
    held."""
    cache = DecodeCache([{"c": (26,)}], 2, capacity=40, device=device)
    s = torch.randn(2, 23, 26, device=device)
    cache.append(0, c=s)
    view = StaticCacheView(cache)
    view.sync()
    view.begin_step()
    new = torch.randn(2, 1, 26, device=device)
    rows = view.append(0, c=new)["c"][:, None]  # (B, 1, capacity, 26)
    q = torch.randn(2, 12, 1, 26, device=device)
    want = _eager(q, torch.cat([s, new], 1)[:, None], torch.cat([s, new], 1)[:, None], 0.25)
    by_bias = decode_attend(q, rows, rows, scale=0.25, bias=view.key_bias(), num_splits=3)
    by_len = decode_attend(q, rows, rows, scale=0.25, lengths=view.key_lengths(), num_splits=3)
    torch.testing.assert_close(by_bias, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_len, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", [_dev(d) for d in DEVICES])
@pytest.mark.parametrize("hkv_bias", [1, 2])
def test_kernel_adds_log_weights(device, hkv_bias):
    """Per-token log-weights (a token selection), per KV head or shared, with -inf entries (filler tokens)."""
    q, k, v = _rows(2, 8, 2, 33, 40, 24, torch.float32, device, seed=3)
    logw = torch.randn(2, hkv_bias, 33, device=device)
    logw[:, :, :4] = float("-inf")
    y = decode_attend(q, k, v, scale=0.2, bias=logw, num_splits=2)
    torch.testing.assert_close(y, _eager(q, k, v, 0.2, logw), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", [_dev(d) for d in DEVICES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dk,dv,shared", [(26, 26, True), (64, 64, False), (24, 40, False)])
def test_kernel_dequantises_int8_rows(device, dtype, dk, dv, shared):
    """int8 rows + fp16 per-row scales (models.stream_cache's format) == attention over the dequantised rows."""
    hq, hkv = (12, 1) if shared else (8, 2)
    q, k, v = _rows(2, hq, hkv, 37, dk, dv, dtype, device, seed=4)
    kq, ks = quantize_int8(k)
    vq, vs = (kq, ks) if shared else quantize_int8(v)
    y = decode_attend(q, kq, vq, scale=0.2, k_scale=ks, v_scale=vs, num_splits=3)
    want = _eager(q, dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32), 0.2)
    torch.testing.assert_close(y.float(), want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device", [_dev(d) for d in DEVICES])
def test_kernel_gives_zeros_to_a_query_that_sees_no_key(device):
    q, k, v = _rows(2, 4, 1, 20, 16, 16, torch.float32, device, seed=5)
    bias = torch.zeros(2, 1, 20, device=device)
    bias[1] = float("-inf")
    y = decode_attend(q, k, v, scale=0.2, bias=bias, num_splits=2)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    torch.testing.assert_close(y[:1], _eager(q[:1], k[:1], v[:1], 0.2), atol=1e-5, rtol=1e-5)


def test_decode_kernel_choice():
    """Resolved once: 'eager' never, 'auto' only with CUDA, 'triton' wherever it can run (here: the interpreter);
    a call uses it only for one query, and on CPU only when forced."""
    assert resolve_decode_kernel("eager") is False
    assert resolve_decode_kernel("auto") is torch.cuda.is_available()
    assert resolve_decode_kernel("triton") is True
    with pytest.raises(ValueError, match="decode_kernel"):
        resolve_decode_kernel("fast")
    one, two = torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 2, 8)
    assert use_decode_kernel(True, "triton", one) and not use_decode_kernel(True, "triton", two)
    assert not use_decode_kernel(True, "auto", one) and not use_decode_kernel(False, "triton", one)


def test_kernel_compiles_for_hopper_and_ampere_without_spills():
    """Compiled Triton, checked without a GPU: tests/split_kv_aot.py compiles the kernels ahead of time for sm_90 and
    sm_80 (the shapes the paths launch: latents of 26 / 77 / 256 at bf16 and int8, R_k != R_v coefficients, fp32 MHA
    rows) in a process without the interpreter — tl.dot's size and type rules apply there — and reports registers and
    local memory; no case may spill."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton build has no bundled CUDA toolchain (ptxas / cuobjdump)")
    script = Path(__file__).resolve().parents[1] / "split_kv_aot.py"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run([sys.executable, str(script), "90", "80"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("OK")]
    assert len(lines) == 9, res.stdout
    assert all(line.endswith("local=0") for line in lines), res.stdout
