"""What ``benchmarks/gpu.py`` measures on a GPU, rows from its settings: SDPA kernels for one decode call, the 124M
training step (ours vs a nanoGPT-style reference, MFU), the decode step (vs transformers' GPT-2), FlashAttention-4."""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from benchmarks.harness.timing import cuda_time, median_of
from benchmarks.lib.reference_gpt import ReferenceGPT
from benchmarks.lib.serving_bench import err, filled_cache, free, weight_bytes
from kvsplice.report.decode_timing import time_steps
from models import GPT, preset
from models.attention import flash_impl, sdpa_order

__all__ = ["PEAK_BF16", "bench_decode", "bench_flash4", "bench_sdpa", "bench_train", "flash4_reason", "peak_flops"]

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12}
"""Dense bf16 tensor-core peak FLOP/s by device family (datasheet), for MFU."""


def peak_flops() -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in torch.cuda.get_device_name()), None)


def bench_sdpa(s: dict) -> Iterator[dict]:
    """Median ms of one decode-shaped SDPA call (key length growing by one per call) per kernel choice, a row per
    ``keys``: a named kernel first in SDPA's priority (the others as fallbacks) by the package's ~1 µs switch."""
    from torch.nn.attention import SDPBackend

    from models.attention import _sdpa_priority

    named = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    choices = {"default": None, **{k: (b, *[x for x in named.values() if x != b]) for k, b in named.items()},
               "ours": "ours"}
    for t_k in s["keys"]:
        row = dict(keys=t_k)
        q = torch.randn(s["sdpa_batch"], 12, 1, 64, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(s["sdpa_batch"], 12, t_k + 2 * s["sdpa_calls"] + 4, 64, device="cuda", dtype=torch.bfloat16)
        for name, order in choices.items():
            n = [t_k]

            def call():
                k = kv[:, :, : n[0]]
                n[0] += 1  # the key length grows by one per call, as in decode
                if order is None:
                    return F.scaled_dot_product_attention(q, k, k)
                with _sdpa_priority(sdpa_order(1, k.shape[-2]) if order == "ours" else order):
                    return F.scaled_dot_product_attention(q, k, k)

            row[name] = median_of(cuda_time, call, s["sdpa_calls"], warmup=1)
        yield row
        del q, kv


def bench_train(s: dict) -> Iterator[dict]:
    """Rows of the training step of ``train_models`` (empty: all), ``compile``: + the torch.compile'd step."""
    batch, t, quick = s["train_batch"], s["train_t"], s["quick"]
    shapes = dict(n_layer=2, n_head=4, d_model=128, block_size=t) if quick else {}
    latent = dict(d_latent=64) if quick else {}
    builders = {
        "reference (nanoGPT-style)": lambda: ReferenceGPT(**{"block_size": t, **shapes}),
        "ours mha": lambda: GPT(preset("gpt2", **shapes)),
        "ours mla": lambda: GPT(preset("mla", **shapes, **latent)),
        "ours mla_kvsplice_90": lambda: GPT(preset("mla_kvsplice_90", **shapes, **latent)),
    }
    if flash_impl() is not None:  # "ours mha" runs the installed FlashAttention (attn_backend auto): SDPA beside it
        builders["ours mha sdpa"] = lambda: GPT(preset("gpt2", attn_backend="sdpa", **shapes))
    if s["train_models"]:
        builders = {k: b for k, b in builders.items() if k in s["train_models"]}
    cases = []  # (label, model builder, compiled, optimizer impl): ours mha with foreach AdamW too
    for label, build in builders.items():
        modes = [(False, "fused")] + [(False, "foreach")] * (label == "ours mha") + [(True, "fused")] * s["compile"]
        cases += [(label, build, compiled, opt) for compiled, opt in modes]
    peak = peak_flops()
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {}
    for label, build, compiled, opt_impl in cases:
        torch.manual_seed(0)
        model = build().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=opt_impl == "fused",
                                foreach=None if opt_impl == "fused" else True)
        fwd = torch.compile(model) if compiled else model
        vocab = model.lm_head.weight.shape[0]
        x, y = (torch.randint(0, vocab, (batch, t), device="cuda", generator=g) for _ in range(2))

        def step(fwd=fwd, opt=opt, model=model, x=x, y=y, vocab=vocab):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = fwd(x)
            loss = F.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        key = (label, "compiled" if compiled else "eager", f"{opt_impl} AdamW")
        n_layer = model.cfg.n_layer if hasattr(model, "cfg") else len(model.h)
        per_token = 6 * sum(p.numel() for p in model.parameters()) + 12 * n_layer * model.lm_head.weight.shape[1] * t
        state[key] = dict(step=step, times=[], warmup_s=time.perf_counter() - t0, flops=per_token * batch * t)
    for r in range(s["rounds"]):  # interleaved: every case sees the same stretches of clock / thermal state
        keys = list(state)
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            state[key]["times"] += cuda_time(state[key]["step"], s["train_steps"])
    ms = {key: statistics.median(c["times"]) for key, c in state.items()}  # (label, mode, optimizer) -> median
    ref = {mode: v for (label, mode, _), v in ms.items() if label.startswith("reference")}
    mha = {mode: v for (label, mode, opt), v in ms.items() if label == "ours mha" and opt == "fused AdamW"}
    for (label, mode, opt), c in state.items():
        v = ms[label, mode, opt]
        yield dict(model=label, mode=mode, optimizer=opt, median_ms=v, tokens_per_s=batch * t / (v / 1e3),
                   tflops=c["flops"] / (v / 1e3) / 1e12, mfu=None if peak is None else c["flops"] / (v / 1e3) / peak,
                   first_steps_s=round(c["warmup_s"], 1), n=len(c["times"]),
                   vs_reference_same_mode=v / ref[mode] if mode in ref else None,
                   vs_ours_mha_same_mode=v / mha[mode] if mode in mha else None)
    del state
    free(torch.device("cuda"))


def _case_ms(model, label: str, batch: int, ctx: int, steps: int, dtype) -> tuple[list[float], int]:
    """ms of ``steps`` decode steps (after 2 untimed) of one case at ``ctx`` (rolled back after each), and the bytes
    of its cache: ours (``+graph``: replayed from a CUDA graph) through :func:`time_steps`, or transformers'."""
    tok = torch.randint(0, 50304, (batch, 1), device="cuda")
    if label.startswith("ours"):
        cache = filled_cache(model, batch, ctx, None)
        nbytes = cache.nbytes() * (ctx + 1) // ctx if ctx else 0
        return [1e3 * t for t in time_steps(model, cache, ctx, tok, 2, steps, graph=label.endswith("+graph"))], nbytes
    from transformers import DynamicCache, StaticCache

    cfg, kind = model.config, "static" if "Static" in label else "dynamic"
    hs = cfg.n_embd // cfg.n_head
    if kind == "static":
        cache = StaticCache(config=cfg, max_cache_len=ctx + 1)
    else:
        cache = DynamicCache(config=cfg) if "config" in DynamicCache.__init__.__code__.co_varnames else DynamicCache()
    pos = torch.arange(ctx, device="cuda")
    for layer in range(cfg.n_layer):
        k = torch.randn(batch, cfg.n_head, ctx, hs, device="cuda", dtype=dtype)
        cache.update(k, torch.randn_like(k), layer, {"cache_position": pos})
        del k
    cache_position = torch.tensor([ctx], device="cuda")
    position_ids = cache_position.view(1, 1).expand(batch, 1)

    def step(tok):
        out = model(input_ids=tok, past_key_values=cache, cache_position=cache_position, position_ids=position_ids,
                    use_cache=True)
        if kind == "dynamic":
            cache.crop(-1)  # drop the step's token (negative: tokens to remove, in every transformers version)
        else:  # transformers 5's static layers count their own write position: rewind it to the same slot
            for layer in getattr(cache, "layers", []):
                if hasattr(layer, "cumulative_length") and torch.is_tensor(layer.cumulative_length):
                    layer.cumulative_length.fill_(ctx)
        return out.logits

    for _ in range(2):
        step(tok)
    return cuda_time(lambda: step(tok), steps), 2 * 12 * batch * (ctx + 1) * 768 * 2


@torch.inference_mode()
def bench_decode(s: dict) -> Iterator[dict]:
    """Per ``batch`` and ``ctx``, ``rounds`` interleaved rounds of every case (each starting from a fresh cache): the
    median ms, its bytes floor, and the ratios to our eager MHA step and to transformers' StaticCache step."""
    dtype = torch.bfloat16
    shapes = dict(n_layer=2, n_head=4, d_model=128, d_latent=64) if s["quick"] else {}
    models = {}
    for name in ("gpt2", "mla", "mla_kvsplice_90"):
        torch.manual_seed(0)
        models[f"ours {name}"] = GPT(preset(name, block_size=max(s["ctx"]) + 1, **shapes)).to("cuda", dtype).eval()
    models.update({f"{k}+graph": m for k, m in models.items()})
    if s["hf"] and not s["quick"]:  # transformers' GPT-2 at the same shapes, one model for both caches
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=50304, n_positions=max(s["ctx"]) + 1, n_embd=768, n_layer=12, n_head=12,
                         attn_implementation="sdpa")
        torch.manual_seed(0)
        models["hf gpt2 DynamicCache"] = models["hf gpt2 StaticCache"] = GPT2LMHeadModel(cfg).to("cuda", dtype).eval()
    labels = list(models)
    for batch, ctx in itertools.product(s["batch"], s["ctx"]):
        times: dict = {lab: [] for lab in labels}
        info: dict = {}
        for r in range(s["rounds"]):
            for lab in labels[r % len(labels):] + labels[: r % len(labels)]:
                try:
                    ms, nbytes = _case_ms(models[lab], lab, batch, ctx, s["decode_steps"], dtype)
                    times[lab] += ms
                    info[lab] = dict(cache_bytes=nbytes, weight_bytes=weight_bytes(models[lab]))
                except Exception as e:  # noqa: BLE001 - out of memory too: one variant must not end it
                    info[lab] = dict(error=err(e))
                    times[lab] = []
                free(torch.device("cuda"))
        cell = {lab: statistics.median(t) for lab, t in times.items() if t}
        mha, static = cell.get("ours gpt2"), cell.get("hf gpt2 StaticCache")
        for lab in labels:
            row = dict(variant=lab, batch=batch, ctx=ctx, **info.get(lab, {}))
            if lab in cell:
                ms, floor_ms = cell[lab], (row["cache_bytes"] + row["weight_bytes"]) / s["bandwidth"] * 1e3
                row.update(median_ms=ms, n=len(times[lab]), floor_ms=floor_ms, vs_floor=ms / floor_ms,
                           vs_ours_mha=ms / mha if mha else None, vs_hf_static=ms / static if static else None)
            yield row
        print(f"decode batch {batch} ctx {ctx}: " + ", ".join(f"{k} {v:.3f}" for k, v in cell.items()),
              file=sys.stderr, flush=True)


def flash4_reason() -> Optional[str]:
    """Why FlashAttention-4 cannot run here, or None."""
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install
        return (f"FlashAttention-4 is not importable ({err(e)}): its wheels with the CUTLASS-DSL runtime (flash-attn-4 "
                "+ nvidia-cutlass-dsl) are > 90 MB, more than the 64 MiB one device call can carry")
    if torch.cuda.get_device_capability() < (9, 0):
        return f"FlashAttention-4 needs compute capability >= 9.0, this is {torch.cuda.get_device_capability()}"
    return None


def bench_flash4(s: dict) -> Iterator[dict]:
    """FlashAttention-4 against SDPA on causal prefill calls of ``flash_shape`` (B, H, T, D), MHA and GQA-4, bf16."""
    from flash_attn.cute import flash_attn_func  # type: ignore[import-not-found]

    from models.attention import FlashImpl, attend

    impl = FlashImpl("flash-attn-4", flash_attn_func, (9, 0), returns_lse=True)
    (b, h, t, d), calls = s["flash_shape"], s["flash_calls"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    for call, (qq, kk, vv) in {f"MHA prefill {b}x{h}x{t}x{d}": (q, k, v),
                               f"GQA-4 prefill {b}x{h}x{t}x{d}": (q, k[:, :h // 4], v[:, :h // 4])}.items():
        row = dict(call=call, impl=impl.name)
        try:
            sd = lambda: attend(qq, kk, vv, scale=d ** -0.5, backend="sdpa")  # noqa: E731
            fl = lambda: attend(qq, kk, vv, scale=d ** -0.5, backend="flash", flash=impl)  # noqa: E731
            row["max_abs_diff"] = (fl().float() - sd().float()).abs().max().item()
            row["sdpa_ms"] = statistics.median(cuda_time(sd, calls))
            row["flash_ms"] = statistics.median(cuda_time(fl, calls))
            row["speedup"] = row["sdpa_ms"] / row["flash_ms"]
        except Exception as e:  # noqa: BLE001
            row["error"] = err(e)
        yield row
