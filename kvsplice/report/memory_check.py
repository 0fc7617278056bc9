"""Measured decode-cache bytes vs the formula (``kvsplice verify-memory``): each variant prefilled and decoded
into its real cache, measured from its tensors, compared at one dtype; and the report table."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from kvsplice.report.memory import cache_bytes_formula, measure_cache, mha_cache_bytes, sequences_in_budget
from kvsplice.io.cli import UsageError, pick_device
from kvsplice.io.configs import named_config
from kvsplice.report.tables import show_table
from models.config import GPTConfig

DEFAULT_CONFIGS = ("gpt2", "mla", "mla_kvsplice_50", "mla_kvsplice_70", "mla_kvsplice_90")
MIB = 2**20
GIB = 2**30


def load_labelled_model(path: str | Path):
    """``(label, model, cfg, meta)`` from :func:`models.checkpoint.load_gpt_checkpoint`."""
    from models.checkpoint import load_gpt_checkpoint

    p = Path(path)
    if not p.exists():
        raise UsageError(f"checkpoint not found: {path}")
    try:
        model, cfg, meta = load_gpt_checkpoint(str(p))
    except Exception as e:  # models.checkpoint.CheckpointError and friends: one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"cannot load checkpoint {path}: {first}") from None
    meta = meta or {}
    label = meta.get("run_name") or meta.get("name") or (f"{p.parent.name}/{p.stem}" if p.parent.name else p.stem)
    return str(label), model, cfg, meta


# ---------------------------------------------------------------------------------------------- variants
@dataclass
class Variant:
    label: str
    cfg: GPTConfig
    source: str
    build: Callable[[], torch.nn.Module]  # the model (fp32 or as loaded); cast and moved by the caller


def preset_variants(specs: Sequence[str], max_len: int, notes: list[str]) -> list[Variant]:
    from models.gpt import GPT

    out = []
    for spec in specs:
        label, cfg, source = named_config(spec)
        if max_len > cfg.block_size:
            notes.append(f"{label}: block_size raised {cfg.block_size} -> {max_len} for the longest sequence "
                         f"(random weights, so only the position table grows)")
            cfg = cfg.replace(block_size=max_len)
        cfg = cfg.replace(dropout=0.0)
        out.append(Variant(label, cfg, source, lambda cfg=cfg: GPT(cfg)))
    return out


def checkpoint_variants(paths: Sequence[str], max_len: int) -> list[Variant]:
    out = []
    for path in paths:
        label, model, cfg, _ = load_labelled_model(path)
        if max_len > cfg.block_size:
            raise UsageError(f"--seq-lens {max_len} exceeds block_size={cfg.block_size} of checkpoint {path} "
                             f"(trained position table; cannot be raised)")
        out.append(Variant(label, cfg, f"ckpt:{path}", lambda model=model: model))
    return out


def quantised_variants(variants: Sequence[Variant], quant: str) -> list[Variant]:
    """Each variant again with ``cfg.cache_quant = quant`` (label ``NAME+int8``): same weights, int8 cache (the
    measurement builds its cache with ``quant=cfg.cache_quant``)."""
    return [Variant(f"{v.label}+{quant}", v.cfg.replace(cache_quant=quant), v.source, v.build) for v in variants]


# -------------------------------------------------------------------------------------------- measurement
def _cuda_bytes(device: torch.device) -> tuple[int, int]:
    """``(requested, allocated)`` bytes live in PyTorch's CUDA allocator: what tensors asked for, and the blocks it
    handed out for them (rounded up to 512 B, and a large block whose remainder is too small to split counts whole)."""
    stats = torch.cuda.memory_stats(device)
    allocated = stats.get("allocated_bytes.all.current", torch.cuda.memory_allocated(device))
    return stats.get("requested_bytes.all.current", allocated), allocated


@torch.inference_mode()
def measure_variant_at(model, cfg: GPTConfig, seq_len: int, *, dtype: torch.dtype, batch: int, decode_steps: int,
                       device: torch.device, budget_bytes: int, generator: torch.Generator) -> dict:
    """Prefill ``seq_len - k`` tokens and decode ``k`` one at a time into a ``capacity=seq_len`` cache; measure it.

    On CUDA the allocator is read around the cache: the bytes requested by ``new_cache`` must equal the formula, and
    after prefill + decode (their transient activations freed) the live requested bytes may have grown only by an
    int8 cache's dequantisation workspace (``cache.workspace_nbytes()``, one layer's rows, documented as not part of
    the cache): no other allocation outlives the steps. A warm-up prefill + decode into a throwaway cache first
    lets the libraries make their persistent workspaces (cuBLAS keeps one per handle), which are not the cache's.
    """
    k = min(decode_steps, seq_len - 1)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=generator).to(device)
    cuda = device.type == "cuda"
    if cuda:
        warm = model.new_cache(batch, capacity=seq_len, quant=cfg.cache_quant)
        model(idx[:, : seq_len - k], cache=warm)
        model(idx[:, seq_len - k : seq_len - k + 1], cache=warm)
        del warm
        torch.cuda.synchronize(device)
        base_req, base_alloc = _cuda_bytes(device)
    cache = model.new_cache(batch, capacity=seq_len, quant=cfg.cache_quant)
    if cuda:
        torch.cuda.synchronize(device)
        req_delta, alloc_delta = (a - b for a, b in zip(_cuda_bytes(device), (base_req, base_alloc)))
    logits = model(idx[:, : seq_len - k], cache=cache)
    for i in range(seq_len - k, seq_len):
        logits = model(idx[:, i : i + 1], cache=cache)
    finite = bool(torch.isfinite(logits).all())
    del logits
    if cuda:
        torch.cuda.synchronize(device)
        resident_req = _cuda_bytes(device)[0] - base_req

    m = measure_cache(cache)
    formula = cache_bytes_formula(cfg, seq_len, dtype, batch)
    mha = mha_cache_bytes(cfg, seq_len, dtype, batch)
    problems = []
    if cache.seq_len != seq_len:
        problems.append(f"cache holds {cache.seq_len} tokens, expected {seq_len}")
    if m.live_bytes != formula:
        problems.append(f"live bytes {m.live_bytes} != formula {formula}")
    if m.storage_bytes != formula:
        problems.append(f"storage bytes {m.storage_bytes} != formula {formula}")
    if cache.nbytes() != formula:
        problems.append(f"cache.nbytes() {cache.nbytes()} != formula {formula}")
    want_dtypes = ("float16", "int8") if cfg.cache_quant == "int8" else (str(dtype).replace("torch.", ""),)
    if m.dtypes != want_dtypes:
        problems.append(f"cache dtypes {m.dtypes} != {want_dtypes}")
    row = dict(
        seq_len=seq_len, batch=batch, prefill_tokens=seq_len - k, decode_steps=k,
        measured_bytes=m.live_bytes, storage_bytes=m.storage_bytes, nbytes_reported=cache.nbytes(),
        formula_bytes=formula, measured_over_formula=m.live_bytes / formula, mha_bytes=mha,
        compression_vs_mha=mha / m.live_bytes, bytes_per_token=formula // (batch * seq_len),
        bytes_per_sequence=m.live_bytes // batch,
        fits_in_budget=sequences_in_budget(budget_bytes, m.live_bytes // batch),
        n_tensors=m.n_tensors, cache_dtypes=list(m.dtypes), logits_finite=finite,
    )
    if cuda:
        row.update(cuda_requested_delta=req_delta, cuda_alloc_delta=alloc_delta, cuda_resident_delta=resident_req)
        if req_delta != formula:
            problems.append(f"CUDA bytes requested by new_cache {req_delta} != formula {formula}")
        if alloc_delta < formula:
            problems.append(f"CUDA allocator delta {alloc_delta} < formula {formula}")
        scratch = cache.workspace_nbytes() if hasattr(cache, "workspace_nbytes") else 0
        row["cuda_workspace_bytes"] = scratch
        if resident_req != req_delta + scratch:
            problems.append(f"CUDA memory changed during prefill + decode: {req_delta} bytes after new_cache, "
                            f"{resident_req} after decode ({scratch} of them the int8 dequantisation workspace)")
    row["ok"] = not problems
    row["problems"] = problems
    del cache
    return row


def run(variants: Sequence[Variant], seq_lens: Sequence[int], *, dtype: torch.dtype, batch: int,
        budget_bytes: int, decode_steps: int = 8, device: Optional[torch.device] = None, progress: bool = True,
        seed: int = 0) -> list[dict]:
    """Measure every variant at every length; one row (dict) per (variant, length)."""
    from tqdm.auto import tqdm

    device = device or pick_device()
    rows = []
    gen = torch.Generator().manual_seed(seed)
    with tqdm(total=len(variants) * len(seq_lens), desc="verify_memory", unit="run", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:
        for v in variants:
            torch.manual_seed(seed)
            model = v.build().to(device=device, dtype=dtype).eval()
            for L in seq_lens:
                bar.set_postfix_str(f"{v.label} L={L}")
                row = measure_variant_at(model, v.cfg, L, dtype=dtype, batch=batch, decode_steps=decode_steps,
                                         device=device, budget_bytes=budget_bytes, generator=gen)
                rows.append(dict(variant=v.label, source=v.source, attention=v.cfg.attention,
                                 kind=v.cfg.variant, n_layer=v.cfg.n_layer, cache_dim=v.cfg.cache_dim, **row))
                bar.update(1)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------ output
def _mib(b: float) -> str:
    return f"{b / MIB:.4g}"


def _fmt_x(x: float) -> str:
    return f"{x:.1f}×" if x < 100 else f"{x:.0f}×"


def table_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    budget = report["budget_gib"]
    cuda = report["device"].startswith("cuda")
    head = ["variant", "tokens", "measured bytes", "formula bytes", "measured MiB", "measured/formula", "vs MHA",
            f"seqs in {budget:g} GiB"] + (["CUDA requested Δ", "CUDA allocated Δ"] if cuda else []) + ["ok"]
    body = []
    for r in report["rows"]:
        body.append([r["variant"], str(r["seq_len"]), f"{r['measured_bytes']:,}", f"{r['formula_bytes']:,}",
                     _mib(r["measured_bytes"]), f"{r['measured_over_formula']:.4f}", _fmt_x(r["compression_vs_mha"]),
                     f"{r['fits_in_budget']:,}"]
                    + ([f"{r['cuda_requested_delta']:,}", f"{r['cuda_alloc_delta']:,}"] if cuda else [])
                    + ["yes" if r["ok"] else "NO"])
    return head, body


def title(report: dict) -> str:
    return (f"KV cache after prefill + decode — dtype {report['dtype']}, batch {report['batch']}, "
            f"device {report['device']}, budget {report['budget_gib']:g} GiB")


def print_table(report: dict, markdown: bool = False) -> None:
    show_table(title(report), *table_rows(report), markdown=markdown,
               row_style=lambda row: None if row[-1] == "yes" else "bold red")
