"""Convert a trained MHA model into MLA (and/or insert KVSplice into an MLA model): a checkpoint of our GPT, or a
pretrained Llama-family model into a decoupled-RoPE MLA model folder.

    kvsplice to-mla --model LLAMA_DIR_OR_GGUF --calib TEXT --d-latent R|full --rope-dims D|all \
        --rope-layout per-head|shared [--latent-norm] [--kvsplice-keep f] [--format native|deepseek_v3] --out DIR

(Llama / Mistral / Qwen2 / Qwen3: :mod:`kvsplice.convert.llama_run`; ``--model`` a converted folder with
``--kvsplice-keep`` shrinks its latent; docs/conversion.md.) For our GPT:

    kvsplice to-mla --model M --d-latent R [--kvsplice-keep f] [--calib TEXT --calib-tokens N] \\
        --out OUT.ckpt [--force] [--json REPORT.json]

``M``: a ``training.fit`` checkpoint (MHA/GQA, or MLA for ``--kvsplice-keep`` alone) or an HF GPT-2 directory / Hub
id (imported with ``GPT.from_hf``). MHA → MLA factorises each layer's stacked key/value projection into
``w_dkv`` / ``w_uk`` / ``w_uv`` (:mod:`kvsplice.convert.mla`): from the weights alone, or — with ``--calib`` —
minimising the key/value error on the calibration text's attention inputs (streamed Grams). ``--kvsplice-keep f``
(the kept fraction of the latent: 0.1 keeps 10 %, the model called KVSplice-90; "ratio" means times smaller
everywhere else; ``--kvsplice-ratio`` is still accepted, with a note) then inserts KVSplice, ``compress``
initialised from the top principal directions of the calibration latents
(``--kvsplice-init pca``, needs ``--calib``) or randomly orthogonal (``--kvsplice-init random``).

The output is a checkpoint that ``training.evaluate``, ``kvsplice.verify_memory --ckpt`` and
``training.fit --config ... --model.init_from OUT.ckpt`` (fine-tuning with a fresh optimizer and schedule) accept;
it keeps the source's data settings, so the tokenizer and validation text follow. Printed: the relative error of
the keys/values on the calibration text and the cache per token before and after. A folder output carries the
marker that to_mla wrote it (:data:`kvsplice.io.marker.MARKER`): ``--force`` replaces only such a folder, whole;
``--json`` is never a file inside it.

Errors are one line on stderr, exit status 2; ``--out`` is never overwritten without ``--force`` and never an input
(``--model``, ``--calib``, ``--tokenizer``), and is written atomically (a killed run's temporary file is removed by
the next run).
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice to-mla"
CALIB_TOKENS = 65536
"""``--calib-tokens`` when not given."""
SELF_CALIB_TOKENS = 16384
"""``--calib-tokens`` when not given with ``--calib self`` (the source writes them: ~40 tokens/s on one CPU core for
a 135M model, once; then read from the cache)."""
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from kvsplice.core.amounts import kept_fraction as _keep, times_smaller as _ratio
from kvsplice.core.limits import MAX_TEXT_TOKENS
from kvsplice.io.cli import (Parser, UsageError, add_device_dtype, add_model_option, add_output_options, add_threads,
                             apply_threads, default_seq_len, device_dtype, pos_int, run_cli)
from kvsplice.io.files import out_and_json
from kvsplice.io.write import disk_errors, write_json

__all__ = ["build_parser", "convert_from_args", "main"]


REFINE_STEPS = 30
"""Default ``--refine-steps`` with ``--ratio`` (SmolLM2 2×: +9.6 % perplexity instead of +16.2 %, the KL halved;
results/convert_fit.md); 0 otherwise (the closed form, exact at full rank)."""


def _steps(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of steps in [0, 100000], got {s}") from None
    if not 0 <= v <= 100000:
        raise argparse.ArgumentTypeError(f"must be a whole number of steps in [0, 100000], got {s}")
    return v


OLD_KEEP = "--kvsplice-ratio"
"""The kept fraction's old spelling, still accepted (with a note): "ratio" means times smaller everywhere else."""


class _OldKeep(argparse.Action):
    """``--kvsplice-ratio f``: ``--kvsplice-keep f``, remembered for the note and the messages."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.kvsplice_keep = values
        namespace.keep_option = OLD_KEEP


def keep_note(args: argparse.Namespace) -> None:
    """The one ``note:`` line of the old spelling."""
    if args.keep_option == OLD_KEEP:
        print(f"note: {OLD_KEEP} is the kept fraction of the latent, now spelled --kvsplice-keep", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description="Convert a trained MHA GPT into MLA / MLA + KVSplice.")
    add_model_option(p, help="training .ckpt (MHA, GQA or MLA), an HF GPT-2 directory, a Llama / Mistral / Qwen2 / "
                     "Qwen3 folder or GGUF file, or a converted MLA folder")
    p.add_argument("--d-latent", default=None, help="latent size R of the MLA model (MHA input); Llama family: "
                   "a number or 'full' (the rank at which the conversion is exact)")
    p.add_argument("--rope-dims", default=None, help="Llama family: RoPE dims per RoPE key (even) or 'all' "
                   "(default: head_dim/8 per-head; all shared — every frequency in the one RoPE key held best on the fine-tune text, "
                   "results/convert_rope_split.md)")
    p.add_argument("--ratio", type=_ratio, default=None, metavar="N",
                   help="Llama family: a cache N times smaller than the source's K/V at the same dtype (2, 4, 8, ...); "
                   "the latent and the shared RoPE key's widths are chosen by the measured attention-output error "
                   "(with --kvsplice-keep: the cache after KVSplice); --d-latent / --rope-dims set them by hand")
    p.add_argument("--refine-steps", type=_steps, default=None, metavar="N",
                   help="Llama family: Adam steps per layer of the layer-local correction against the source layer's "
                   f"outputs on a calibration window (default {REFINE_STEPS} with --ratio, else 0: the closed form "
                   "alone)")
    p.add_argument("--rope-layout", choices=("per-head", "shared"), default=None,
                   help="Llama family: a RoPE key per KV head (MHA2MLA) or one shared per token (TransMLA/DeepSeek; "
                   "default with --ratio, else per-head)")
    p.add_argument("--latent-norm", action="store_true", help="Llama family: RMSNorm the latent (DeepSeek's "
                   "kv_a_layernorm; exact at no rank, unusable training-free: without it --format deepseek_v3 writes "
                   "the norm in its linear regime, docs/conversion.md)")
    p.add_argument("--format", choices=("native", "deepseek_v3"), default="native",
                   help="Llama family: the output folder's format (native: kvsplice loads it; deepseek_v3: "
                   "transformers / vLLM / SGLang load it)")
    p.add_argument("--pad-latent", type=pos_int, default=None, help="--format deepseek_v3: zero-pad the exported "
                   "latent to this size, exactly (through its RMSNorm), e.g. 512 for vLLM's MLA (latent + RoPE in "
                   "320 / 512 / 576; its CPU kernel 512 + 64)")
    p.add_argument("--pad-rope", type=pos_int, default=None, help="--format deepseek_v3: write the RoPE key with this "
                   "many dims (a multiple of --rope-dims; its frequencies kept exactly), e.g. 64 for vLLM's CPU MLA")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    keep = p.add_mutually_exclusive_group()  # one kept fraction: both spellings together are refused, not one dropped
    keep.add_argument("--kvsplice-keep", type=_keep, default=None, metavar="F",
                   help="insert KVSplice keeping round(R·F) of the latent's R numbers per token (F = 0.5/0.3/0.1 "
                   "keeps 50/30/10 %%: KVSplice-50/70/90)")
    keep.add_argument(OLD_KEEP, type=_keep, action=_OldKeep, dest="kvsplice_keep", metavar="F",
                   help="the same as --kvsplice-keep (its old name)")
    p.set_defaults(keep_option="--kvsplice-keep")
    p.add_argument("--kvsplice-init", choices=("pca", "random"), default="pca",
                   help="compress init: top principal directions of the calibration latents, or random orthogonal")
    p.add_argument("--calib", default=None, help="calibration text (.txt/.json/.jsonl or folder): activation-aware "
                   "conversion and the KVSplice PCA init; Llama family: 'self' is the source's own text (sampled once "
                   "from prompts across domains and cached, as kvsplice distill's; keeps other prose and retrieval "
                   "where one domain's text loses them, docs/conversion.md)")
    p.add_argument("--calib-tokens", type=pos_int, default=None, help=f"calibration tokens (default {CALIB_TOKENS}, "
                   f"{SELF_CALIB_TOKENS} with --calib self, or the whole text if shorter; at most {MAX_TEXT_TOKENS} "
                   f"and what --calib can give)")
    p.add_argument("--seq-len", type=pos_int, default=None, help="calibration window (default: the model's context, at "
                   "most 1024; Llama family: at most 2048)")
    p.add_argument("--batch-size", type=pos_int, default=8)
    p.add_argument("--seed", type=int, default=0, help="seed of a random KVSplice init")
    p.add_argument("--tokenizer", default=None, help="tokenizer files when the model does not bring its own")
    add_output_options(p, out_help="output checkpoint (.ckpt); Llama family: a model folder",
                       force_help="overwrite --out / --json (a folder: only one to_mla wrote, replaced whole)")
    add_threads(p)
    add_device_dtype(p, dtype=False)  # the converted checkpoint keeps the source's dtype (fp32 training weights)
    return p


def convert_from_args(args: argparse.Namespace) -> tuple[Any, dict[str, Any], dict]:
    """Load, calibrate and convert; returns ``(model, report, meta)`` (``meta``: the source's hparams)."""
    from kvsplice.convert.mla import (attention_input_grams, insert_kvsplice, kv_relative_error, latent_grams,
                                      mha_to_mla)
    from kvsplice.loading import checkpoint_tokenizer, iter_texts, load_model, load_tokenizer, token_stream
    from kvsplice.lowrank.calibrate import calibration_batches
    from models.checkpoint import load_gpt_checkpoint as load_ckpt
    from models.gpt import GPT

    t0 = time.perf_counter()
    if Path(args.model).expanduser().is_file():  # our checkpoint: MHA, GQA or (for --kvsplice-keep) MLA
        model, _, meta = load_ckpt(args.model)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else checkpoint_tokenizer(meta, Path(args.model))
    else:
        loaded = load_model(args.model, tokenizer=args.tokenizer)
        if getattr(loaded.model.config, "model_type", None) != "gpt2":
            raise UsageError(f"--model {args.model}: a {type(loaded.model).__name__}; to_mla converts our GPT "
                             f"checkpoints, HF GPT-2 and local Llama-family folders / GGUF files")
        model, meta, tokenizer = GPT.from_hf(loaded.model).eval(), {}, loaded.tokenizer
    device, _ = device_dtype(args)
    model = model.to(device)  # calibration and conversion run there; the checkpoint is saved from CPU copies
    cfg = model.cfg
    if cfg.attention == "mha" and args.d_latent is None:
        raise UsageError(f"--model is an MHA model ({cfg.variant}): give --d-latent R (1..{cfg.d_model})")
    if cfg.attention == "mla":
        if cfg.kvsplice_keep is not None:
            raise UsageError(f"--model already has KVSplice ({cfg.variant}); convert its MLA parent instead")
        if args.kvsplice_keep is None:
            raise UsageError("--model is already MLA: give --kvsplice-keep F to insert KVSplice (the kept fraction)")
        if args.d_latent not in (None, cfg.d_latent):
            raise UsageError(f"--d-latent {args.d_latent}: the MLA model's latent is {cfg.d_latent} (leave it out)")
    if args.d_latent is not None and args.d_latent > cfg.d_model:
        raise UsageError(f"--d-latent {args.d_latent} is larger than d_model={cfg.d_model}")
    if args.kvsplice_keep is not None:  # at least one whole latent dimension, checked before calibrating
        from kvsplice.convert.kvsplice_keep import kept_dims

        try:
            kept_dims(args.kvsplice_keep, args.d_latent if cfg.attention == "mha" else cfg.d_latent,
                      args.keep_option)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.kvsplice_keep is not None and args.kvsplice_init == "pca" and not args.calib:
        raise UsageError("--kvsplice-init pca needs --calib TEXT (the latents' principal directions), or use "
                         "--kvsplice-init random")
    batches, n_tokens = None, 0
    if args.calib:
        seq_len = args.seq_len or default_seq_len(cfg.block_size)
        if seq_len > cfg.block_size:
            raise UsageError(f"--seq-len {seq_len} exceeds the model's block_size {cfg.block_size}")
        n_max = args.calib_tokens or CALIB_TOKENS  # None: a Namespace parsed without _main's check
        ids, _ = token_stream(iter_texts(args.calib, option="calib"), tokenizer, n_max)
        if ids.numel() < seq_len:
            raise UsageError(f"--calib {args.calib}: only {ids.numel()} tokens, fewer than --seq-len {seq_len}")
        batches = calibration_batches(ids, seq_len, args.batch_size, max_tokens=n_max)
        n_tokens = sum(b.numel() for b in batches)
    report: dict[str, Any] = {"source": str(args.model), "source_variant": cfg.variant,
                              "source_cache_dim": cfg.cache_dim, "calibration_tokens": n_tokens,
                              "calibration_source": args.calib}
    out = model
    if cfg.attention == "mha":
        grams = attention_input_grams(model, batches, progress=True)[0] if batches is not None else None
        out = mha_to_mla(model, args.d_latent, grams)
        report["method"] = "activation-aware" if grams is not None else "weights-only"
        if grams is not None:
            report["kv_relative_error"] = kv_relative_error(model, out, grams)
    if args.kvsplice_keep is not None:
        lat = latent_grams(out, batches, progress=True)[0] if args.kvsplice_init == "pca" else None
        out = insert_kvsplice(out, args.kvsplice_keep, lat, seed=args.seed)
        report["kvsplice_init"] = args.kvsplice_init
    report.update(variant=out.cfg.variant, d_latent=out.cfg.d_latent, cache_dim=out.cfg.cache_dim,
                  compression_vs_source=cfg.cache_dim / out.cfg.cache_dim, seconds=time.perf_counter() - t0)
    return out, report, meta


def _gpt_latent(v: str) -> int:
    try:
        return pos_int(v)
    except (ValueError, argparse.ArgumentTypeError):
        raise UsageError(f"--d-latent {v}: must be >= 1 (the latent size of the GPT model's MLA)") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvsplice.loading import LoadError
    from models.checkpoint import CheckpointError

    return run_cli(PROG, lambda: _main(argv), (LoadError, CheckpointError))


def _main(argv: Optional[Sequence[str]]) -> int:
    from models.checkpoint import save_model

    args = build_parser().parse_args(argv)
    keep_note(args)
    apply_threads(args)
    from kvsplice.core.limits import check_count
    from kvsplice.loading import text_tokens
    from kvsplice.loading.self_text import SELF

    if args.calib == SELF:  # the source writes it: bounded here, generated after the model loads
        args.calib_tokens = check_count("--calib-tokens", SELF_CALIB_TOKENS if args.calib_tokens is None
                                        else args.calib_tokens, hi=MAX_TEXT_TOKENS)
    else:
        args.calib_tokens = text_tokens("--calib-tokens", args.calib_tokens, CALIB_TOKENS, args.calib,
                                        text_option="calib")  # before the model loads
    from kvsplice.convert.llama_run import is_llama_source, run_llama

    if is_llama_source(args.model):  # Llama family -> decoupled-RoPE MLA (kvsplice.convert.llama_mla)
        if args.refine_steps is None:
            args.refine_steps = REFINE_STEPS if args.ratio is not None else 0
        return run_llama(args)
    for opt in ("rope_dims", "latent_norm", "pad_latent", "pad_rope", "ratio", "rope_layout", "refine_steps"):
        if getattr(args, opt):
            raise UsageError(f"--{opt.replace('_', '-')} is for Llama-family models; --model {args.model} is not one")
    if args.format != "native":
        raise UsageError("--format deepseek_v3 is for Llama-family models (shared RoPE layout)")
    if args.calib == SELF:
        raise UsageError(f"--calib self is the source's own text, written by a Llama-family model; --model "
                         f"{args.model} is not one: give --calib TEXT")
    if args.d_latent is not None:
        args.d_latent = _gpt_latent(args.d_latent)
    out_path, json_path = out_and_json(args.out, args.json, force=args.force,
                                       inputs={"--model": args.model, "--calib": args.calib,
                                               "--tokenizer": args.tokenizer})
    model, report, meta = convert_from_args(args)
    with disk_errors(out_path):  # a full disk: torch.save's own error, one line; atomic_write leaves nothing
        save_model(model, out_path, hparams=meta.get("hparams"), data_hparams=meta.get("data_hparams"),
                   extra={"kvsplice_conversion": {k: v for k, v in report.items() if k != "seconds"}})
    err = report.get("kv_relative_error")
    print(f"{report['source_variant']} ({report['source_cache_dim']} numbers/token/layer) -> {report['variant']} "
          f"({report['cache_dim']}; {report['compression_vs_source']:.2f}x smaller), "
          f"{report.get('method', 'MLA kept')}" + (f", KVSplice init {report['kvsplice_init']}"
                                                    if "kvsplice_init" in report else ""))
    if err:
        print("relative K/V error on the calibration inputs per layer: " + ", ".join(f"{e:.4f}" for e in err))
    print(f"saved {out_path} ({report['seconds']:.1f} s)")
    if json_path is not None:
        with disk_errors(json_path):
            write_json({**report, "out": str(out_path)}, json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
