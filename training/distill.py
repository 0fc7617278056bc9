"""Fine-tune a converted MLA model (``python -m kvsplice.to_mla`` output) with Lightning: LM loss or KL distillation
from the source model, on local text. ``--model`` may also be the unconverted source (a transformers folder or GGUF
file) fine-tuned with ``--loss lm`` on the same text and steps: the baseline that separates recovering from the
conversion from adapting to the text.

    python -m training.distill --model MLA_DIR --teacher SOURCE --data TEXT [--loss kl|lm] [--max-steps 60] \\
        [--batch-size 4] [--seq-len 128] [--lr 2e-4] [--precision 32|bf16-mixed] [--run-name NAME] \\
        [--runs-dir checkpoints] [--ckpt-path last] [--overwrite] [--no-progress]

The CPU-sized defaults (60 steps of 4 × 128 tokens) run in minutes on stories260K-sized models. The run folder is
placed like ``training.fit``'s (:mod:`training.rundir`: ``<runs_dir>/<run_name>/``, never into an earlier run,
``-v1`` ...; ``--ckpt-path last`` resumes weights, optimizer, schedule and the data position exactly) and holds
``last.ckpt`` / ``best-step=...ckpt`` (lowest validation LM loss, written atomically, loaded without pickle),
``metrics.csv`` (train/val loss, KL, tokens, lr) and, at the end, ``model/``: the fine-tuned model folder that every
kvsplice command loads (an unconverted model: a transformers folder, ``save_pretrained``) (``python -m kvsplice.to_mla --model RUN/model --format deepseek_v3 --out DIR`` exports it).
The last ``--val-tokens`` of the text are held out for validation. ``--precision bf16-mixed`` on a GPU.

Errors are one ``distill: error: ...`` line on stderr, exit status 2.
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice distill"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from kvsplice.io.cli import Parser, UsageError, add_model_option, add_threads, apply_threads, pos_int, run_cli

__all__ = ["build_parser", "main", "split", "tokens_needed"]


def _steps(s: str) -> int:
    """argparse type: a whole number of steps >= 0 (-1 warm-up steps ran without a word)."""
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def build_parser() -> Parser:
    from training.lit_distill import LOSSES

    p = Parser(prog=PROG, description="Fine-tune a converted MLA model (LM loss or KL "
               "distillation from its source) with Lightning.")
    add_model_option(p, help="a converted MLA model folder (python -m kvsplice.to_mla), or an unconverted "
                     "transformers model / GGUF file (the same-text baseline)")
    p.add_argument("--teacher", default=None, help="the source model (folder / GGUF) for --loss kl")
    p.add_argument("--data", "--data.path", dest="data", required=True, help="training text (.txt/.json/.jsonl)")
    p.add_argument("--loss", choices=LOSSES, default="kl", help="kl: distil from --teacher (default); lm: LM loss")
    p.add_argument("--max-steps", type=pos_int, default=60)
    p.add_argument("--batch-size", type=pos_int, default=4)
    p.add_argument("--seq-len", type=pos_int, default=128)
    p.add_argument("--tokens", type=pos_int, default=None, help="training tokens read from --data (default: "
                   "enough for max-steps batches)")
    p.add_argument("--val-tokens", type=pos_int, default=4096, help="held-out tokens from the end of --data")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=_steps, default=None, help="default: 10%% of --max-steps")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--val-every", type=pos_int, default=20, help="validate every N steps")
    p.add_argument("--precision", default=None, help="Lightning precision (default: bf16-mixed on CUDA, else 32)")
    p.add_argument("--runs-dir", default="checkpoints")
    p.add_argument("--run-name", default=None, help="default: distill-<model folder name>")
    p.add_argument("--ckpt-path", default=None, help="last | best | a checkpoint file: resume")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    add_threads(p)
    p.add_argument("--no-progress", action="store_true")
    return p


def _windows(ids: torch.Tensor, t: int) -> torch.Tensor:
    """``(n, t + 1)`` windows of ``ids`` (inputs and their next-token targets), each sharing its last token with
    the next one's first: ``n * t + 1`` tokens make ``n``."""
    n = (ids.numel() - 1) // t
    return torch.stack([ids[i * t:i * t + t + 1] for i in range(n)]) if n else ids.new_zeros(0, t + 1)


def tokens_needed(train_tokens: int, val_tokens: int) -> int:
    """Tokens to read for ``train_tokens`` of training windows and ``val_tokens`` held out: each part one token
    more than its windows' inputs (the last target) — :func:`split` of that many gives both in full."""
    return (train_tokens + 1) + (val_tokens + 1)


def split(ids: torch.Tensor, t: int, val_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)`` windows of length ``t`` (:func:`_windows`): the held-out part is the last ``val_tokens + 1``
    tokens, never seen in training."""
    return _windows(ids[:-val_tokens - 1], t), _windows(ids[-val_tokens - 1:], t)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvsplice.loading import LoadError
    from models.checkpoint import CheckpointError
    from training.rundir import CLIConfigError

    return run_cli(PROG, lambda: _main(argv), (LoadError, CheckpointError, CLIConfigError))


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    import warnings

    for pattern in (r"Checkpoint directory .* exists and is not empty",  # the run dir holds metrics.csv too
                    r".*isinstance\(treespec, LeafSpec\)", r".*litlogger",
                    r"You.re resuming from a checkpoint that ended before the epoch"):  # the step drives the data
        warnings.filterwarnings("ignore", message=pattern)
    apply_threads(args)  # within the CPUs (100000 was handed to torch: a traceback)
    from training.checkpoint import check_resume_file

    check_resume_file(args.ckpt_path, "--ckpt-path")  # a refused checkpoint is the first line, before any loading
    from kvsplice.loading import iter_texts, load_model, token_stream
    from models.mla_llama import MLALlama

    student = load_model(args.model)
    if not isinstance(student.model, MLALlama) and not hasattr(student.model, "save_pretrained"):
        raise UsageError(f"--model {args.model}: not a converted MLA folder (make one with python -m kvsplice.to_mla) "
                         f"nor a transformers causal LM")
    if args.loss == "kl" and not args.teacher:
        raise UsageError("--loss kl needs --teacher SOURCE (the model it was converted from), or use --loss lm")
    teacher = load_model(args.teacher).model if args.loss == "kl" else None
    vocab = student.model.get_input_embeddings().weight.shape[0]
    if teacher is not None and teacher.get_input_embeddings().weight.shape[0] != vocab:
        raise UsageError(f"--teacher {args.teacher}: its vocabulary differs from the student's")
    t, b = args.seq_len, args.batch_size
    if student.max_positions and t > student.max_positions:
        raise UsageError(f"--seq-len {t} exceeds the model's {student.max_positions} positions")
    want = tokens_needed(args.tokens or args.max_steps * b * t, args.val_tokens)
    ids, _ = token_stream(iter_texts(args.data, option="data"), student.tokenizer, want)
    train, val = split(ids, t, args.val_tokens)
    if len(val) == 0 or len(train) < b:
        raise UsageError(f"--data {args.data}: {ids.numel()} tokens, too few for --val-tokens {args.val_tokens} and "
                         f"a batch of {b} x {t}")
    return _fit(args, student, teacher, train, val)


def _fit(args, student, teacher, train: torch.Tensor, val: torch.Tensor) -> int:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from kvsplice.io.folders import write_dir
    from training.checkpoint import safe_checkpoint_io
    from training.lit_distill import LitDistill
    from training.loggers import RunCSVLogger
    from training.rundir import place_run

    plan = place_run(args.runs_dir, args.run_name or f"distill-{Path(args.model).name}", args.ckpt_path,
                     args.overwrite)
    try:
        for n in plan.notes:
            print(f"note: {n}", file=sys.stderr)
        L.seed_everything(args.seed, verbose=False)
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.max_steps // 10)
        lit = LitDistill(student.model.train(), train, val, teacher=teacher, loss=args.loss, lr=args.lr,
                         warmup_steps=warmup, max_steps=args.max_steps, batch_size=args.batch_size,
                         temperature=args.temperature)
        logger = RunCSVLogger(str(plan.run_dir))
        if plan.resume:
            step = int(torch.load(plan.ckpt_path, weights_only=True, map_location="cpu").get("global_step", 0))
            logger.resume_at(step)
        ckpt = ModelCheckpoint(dirpath=str(plan.run_dir), filename="best-{step}-{val_loss:.4f}", monitor="val_loss",
                               save_last=True, save_top_k=1, auto_insert_metric_name=True)
        precision = args.precision or ("bf16-mixed" if torch.cuda.is_available() else "32")
        trainer = L.Trainer(max_steps=args.max_steps, precision=precision, logger=logger, callbacks=[ckpt],
                            plugins=[safe_checkpoint_io()], enable_progress_bar=not args.no_progress,
                            val_check_interval=min(args.val_every, args.max_steps), check_val_every_n_epoch=None,
                            log_every_n_steps=1, enable_model_summary=False, num_sanity_val_steps=0)
        ticks = torch.utils.data.DataLoader(range(args.max_steps), batch_size=1)  # the step drives the data
        vals = torch.utils.data.DataLoader(val, batch_size=args.batch_size)
        trainer.fit(lit, train_dataloaders=ticks, val_dataloaders=vals, ckpt_path=plan.ckpt_path)
        model = lit.student.eval().float().cpu()
        write_dir(plan.run_dir / "model", lambda tmp: _save_model(model, tmp, student.tokenizer.backend))
        print(f"fine-tuned {args.model} for {trainer.global_step} steps ({args.loss}); run {plan.run_dir}, model "
              f"folder {plan.run_dir / 'model'}")
    finally:
        plan.release()
    return 0


def _save_model(model, folder: Path, tokenizer) -> None:
    """The fine-tuned model as a folder every kvsplice command loads: our MLA folder, or ``save_pretrained``."""
    from kvsplice.loading.mla_folder import save_mla_folder
    from models.mla_llama import MLALlama

    if isinstance(model, MLALlama):
        save_mla_folder(model, folder, tokenizer)
        return
    model.save_pretrained(str(folder), safe_serialization=True)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))


if __name__ == "__main__":
    sys.exit(main())
