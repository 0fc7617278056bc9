"""Fine-tune a converted MLA model (``kvsplice to-mla`` output) with Lightning: KL distillation from the source model
(or the LM loss), by default on the source's own text, within a time budget. ``--model`` may also be the unconverted
source (a transformers folder or GGUF file) fine-tuned with ``--loss lm`` on the same text and steps: the baseline
that separates recovering from the conversion from adapting to the text.

    kvsplice distill --model MLA_DIR --teacher SOURCE [--minutes 60] [--snapshot-minutes 15 30] \\
        [--data TEXT | --self-tokens N --cache-dir DIR] [--seq-len 1024 2048] [--batch-size 2] [--max-steps N] \\
        [--trainable all|attention] [--loss kl|lm] [--lr 2e-4] [--devices N] [--precision 32|bf16-mixed] \\
        [--run-name NAME] [--runs-dir checkpoints] [--ckpt-path last] [--overwrite] [--no-progress]

Data: without ``--data`` the teacher writes the text (:mod:`kvsplice.loading.self_text`: diverse prompts, sampled once and
cached; the first ``--val-tokens`` are held out); ``--data TEXT`` trains on a file as before (its last
``--val-tokens`` held out). Windows alternate 1,024 and 2,048 tokens by step within the model's positions
(:mod:`training.distill_data`), ``--batch-size`` windows of the first length per step (the same tokens every step).
Length: ``--minutes M`` stops after M minutes of training with the learning rate decayed over the budget
(:mod:`training.distill_budget`), else ``--max-steps`` (default 60 without ``--minutes``). The run folder is placed
like ``training.fit``'s (:mod:`training.rundir`; ``--ckpt-path last`` resumes weights, optimizer, schedule, data
position and the elapsed minutes) and holds ``last.ckpt`` / ``best-step=...ckpt``, ``metrics.csv``, ``curve.csv``
(held-out KL and loss against minutes), ``model-<M>min/`` at the ``--snapshot-minutes`` marks and, at the end,
``model/``: the fine-tuned model folder that every kvsplice command loads (``kvsplice to-mla --model RUN/model
--format deepseek_v3 --out DIR`` exports it). ``--devices N``: N processes with Lightning's DDP (gloo on a CPU).

Errors are one ``distill: error: ...`` line on stderr, exit status 2.
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice distill"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from kvsplice.io.cli import Parser, UsageError, apply_threads, run_cli
from training.distill_options import SELF_TOKENS_MINUTES, DistillOptions

__all__ = ["build_parser", "main", "options", "split", "tokens_needed"]

def build_parser() -> Parser:
    """The command line of :class:`~training.distill_options.DistillOptions` (its fields declare it)."""
    from kvsplice.io.options import add_options
    from training.distill_options import DistillOptions

    p = Parser(prog=PROG, description="Fine-tune a converted MLA model (KL distillation from its source, or the LM "
               "loss) with Lightning, by default on the source's own text.")
    add_options(p, DistillOptions)
    return p


def options(argv: Optional[Sequence[str]] = None):
    """The checked options of a command line (:class:`~training.distill_options.DistillOptions`)."""
    from kvsplice.io.options import from_args
    from training.distill_options import DistillOptions

    return from_args(DistillOptions, build_parser().parse_args(argv))


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
    opts = options(argv)
    import warnings

    for pattern in (r"Checkpoint directory .* exists and is not empty",  # the run dir holds metrics.csv too
                    r".*isinstance\(treespec, LeafSpec\)", r".*litlogger",
                    r"You.re resuming from a checkpoint that ended before the epoch"):  # the step drives the data
        warnings.filterwarnings("ignore", message=pattern)
    apply_threads(opts)  # within the CPUs (100000 was handed to torch: a traceback)
    from training.checkpoint import check_resume_file

    check_resume_file(opts.ckpt_path, "--ckpt-path")  # a refused checkpoint is the first line, before any loading
    from kvsplice.loading import load_model
    from models.mla_llama import MLALlama
    from training.distill_data import window_lengths

    student = load_model(opts.model)
    if not isinstance(student.model, MLALlama) and not hasattr(student.model, "save_pretrained"):
        raise UsageError(f"--model {opts.model}: not a converted MLA folder (make one with kvsplice to-mla) "
                         f"nor a transformers causal LM")
    if opts.loss == "kl" and not opts.teacher:
        raise UsageError("--loss kl needs --teacher SOURCE (the model it was converted from), or use --loss lm")
    if opts.data and opts.tokens:  # counted in the student's tokens, before the teacher loads
        _check_data_holds(opts, student.tokenizer)
    teacher_loaded = load_model(opts.teacher) if opts.teacher else None
    teacher = teacher_loaded.model if opts.loss == "kl" else None
    vocab = student.model.get_input_embeddings().weight.shape[0]
    if teacher is not None and teacher.get_input_embeddings().weight.shape[0] != vocab:
        raise UsageError(f"--teacher {opts.teacher}: its vocabulary differs from the student's")
    positions = _positions(student, teacher_loaded)
    lengths = window_lengths(opts.seq_len, positions)
    if positions and max(lengths) > positions:
        raise UsageError(f"--seq-len {max(lengths)} exceeds the model's {positions} positions")
    step_tokens = opts.batch_size * lengths[0]
    from kvsplice.core.limits import check_fits

    try:  # a step's logits (student, teacher, their gradient) before any of them is allocated
        check_fits("--batch-size", 12.0 * step_tokens * vocab, f"a step of {opts.batch_size} x {lengths[0]} tokens "
                   f"over a {vocab:,}-token vocabulary")
    except ValueError as e:
        raise UsageError(str(e)) from None
    max_steps = opts.max_steps or (None if opts.minutes else 60)
    if opts.data:
        train, val = _text_data(opts, student, max_steps, step_tokens, lengths)
    else:
        train, val = _self_data(opts, teacher_loaded or student, max_steps, step_tokens, lengths)
    if len(val) == 0 or train.numel() < max(lengths) + 2:
        raise UsageError(f"--data {opts.data or '(self text)'}: {train.numel() + val.numel()} tokens, too few for "
                         f"--val-tokens {opts.val_tokens} and a window of {max(lengths)}")
    return _fit(opts, student, teacher, train, val, lengths, step_tokens, max_steps)


def _positions(*loaded) -> Optional[int]:
    """The fewest positions of the models given (an MLA model's ``cfg.max_positions`` included)."""
    got = [m.max_positions or getattr(getattr(m.model, "cfg", None), "max_positions", None)
           for m in loaded if m is not None]
    return min((p for p in got if p), default=None)


def _check_data_holds(opts: DistillOptions, tokenizer) -> None:
    """``--tokens`` within what ``--data`` holds (with ``--val-tokens`` held out): a one-line :class:`UsageError`
    naming the file's tokens, rather than training on fewer than asked."""
    from kvsplice.loading import iter_texts, token_stream

    want = tokens_needed(opts.tokens, opts.val_tokens)
    ids, _ = token_stream(iter_texts(opts.data, option="data"), tokenizer, want)
    if ids.numel() < want:
        n = ids.numel()
        raise UsageError(f"--tokens {opts.tokens:,}: --data {opts.data} holds {n:,} tokens, fewer than --tokens + "
                         f"--val-tokens {opts.val_tokens:,} + 2 = {want:,} (give --tokens of at most "
                         f"{max(0, n - opts.val_tokens - 2):,}, or more text)")


def _text_data(opts: DistillOptions, student, max_steps, step_tokens: int,
               lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """``--data``: the train stream and the held-out windows (its last ``--val-tokens``)."""
    from kvsplice.loading import iter_texts, token_stream

    train_tokens = opts.tokens or (max_steps or 0) * step_tokens or SELF_TOKENS_MINUTES
    want = tokens_needed(max(train_tokens, max(lengths) + 1), opts.val_tokens)  # at least the longest window
    ids, _ = token_stream(iter_texts(opts.data, option="data"), student.tokenizer, want)
    return ids[:-opts.val_tokens - 1], _windows(ids[-opts.val_tokens - 1:], lengths[0])


def _self_data(opts: DistillOptions, source, max_steps, step_tokens: int,
               lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """No ``--data``: the source's own text (:mod:`kvsplice.loading.self_text`; ``source`` is the teacher, or the model
    itself for ``--loss lm``); the first ``--val-tokens`` are held out, the same for every corpus length."""
    from kvsplice.loading.self_text import SelfTextError, SelfTextOptions, self_text

    train_tokens = opts.self_tokens or (max_steps * step_tokens if max_steps else SELF_TOKENS_MINUTES)
    text_opts = SelfTextOptions(tokens=tokens_needed(max(train_tokens, max(lengths) + 1), opts.val_tokens),
                                seed=opts.seed)
    model = source.model
    if torch.cuda.is_available():
        model.cuda()
    try:
        got = self_text(model, source.tokenizer, text_opts, cache_dir=opts.cache_dir,
                        max_positions=source.max_positions, progress=opts.progress)
    except SelfTextError as e:
        raise UsageError(f"{e}: the teacher writes the default text; pass --data TEXT") from None
    finally:
        model.cpu()
    if got.generated:
        print(f"self text: generated {got.generated:,} tokens in {got.seconds:.0f} s "
              f"({got.generated / max(got.seconds, 1e-9):.1f} tokens/s), cached in {got.path}", file=sys.stderr)
    else:
        print(f"self text: {got.ids.numel():,} tokens from the cache {got.path}", file=sys.stderr)
    head = opts.val_tokens + 1
    return got.ids[head:], _windows(got.ids[:head], lengths[0])


def _fit(opts: DistillOptions, student, teacher, train: torch.Tensor, val: torch.Tensor, lengths, step_tokens: int,
         max_steps: Optional[int]) -> int:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from kvsplice.io.folders import write_dir
    from training.checkpoint import safe_checkpoint_io
    from training.distill_budget import BudgetBar, TimeBudget
    from training.distill_data import StepWindows
    from training.lit_distill import LitDistill
    from training.loggers import RunCSVLogger
    from training.rundir import place_run

    plan = place_run(opts.runs_dir, opts.run_name or f"distill-{Path(opts.model).name}", opts.ckpt_path,
                     opts.overwrite)
    try:
        if plan.clear:  # --overwrite: the earlier run's checkpoints, curve and model folders go (not kept as -v1)
            _clear_distill_run(plan.run_dir)
        for n in plan.notes if _rank_zero() else ():  # DDP processes use rank 0's folder
            print(f"note: {n}", file=sys.stderr)
        L.seed_everything(opts.seed, verbose=False)
        tok = student.tokenizer.backend

        def save(folder: Path) -> None:
            write_dir(folder, lambda tmp: _save_model(lit.student, tmp, tok))

        clock = TimeBudget(plan.run_dir, opts.minutes, opts.snapshot_minutes, save)
        warmup = opts.warmup_steps if opts.warmup_steps is not None else (
            max(1, max_steps // 10) if max_steps and not opts.minutes else 10)
        try:
            lit = LitDistill(student.model.train(), StepWindows(train, lengths, step_tokens), val, teacher=teacher,
                             loss=opts.loss, lr=opts.lr, warmup_steps=warmup, max_steps=max_steps or 0,
                             temperature=opts.kl_temperature, trainable=opts.trainable, clock=clock)
        except ValueError as e:
            raise UsageError(str(e)) from None
        logger = RunCSVLogger(str(plan.run_dir))
        if plan.resume:
            step = int(torch.load(plan.ckpt_path, weights_only=True, map_location="cpu").get("global_step", 0))
            logger.resume_at(step)
        ckpt = ModelCheckpoint(dirpath=str(plan.run_dir), filename="best-{step}-{val_loss:.4f}", monitor="val_loss",
                               save_last=True, save_top_k=1, auto_insert_metric_name=True)
        precision = opts.precision or ("bf16-mixed" if torch.cuda.is_available() else "32")
        callbacks = [ckpt, clock] + ([] if not opts.progress else [BudgetBar(max_steps is None)])
        ddp = {"strategy": "ddp"} if opts.devices > 1 else {}
        trainer = L.Trainer(max_steps=max_steps or -1, max_epochs=-1, precision=precision, logger=logger,
                            callbacks=callbacks, plugins=[safe_checkpoint_io()],
                            enable_progress_bar=opts.progress, devices=opts.devices, **ddp,
                            use_distributed_sampler=False,  # the step picks each process's windows
                            val_check_interval=min(opts.val_every, max_steps or opts.val_every),
                            check_val_every_n_epoch=None, log_every_n_steps=1, enable_model_summary=False,
                            num_sanity_val_steps=0)
        ticks = torch.utils.data.DataLoader(range(max_steps or 10**9), batch_size=1)  # the step drives the data
        vals = torch.utils.data.DataLoader(val, batch_size=max(1, step_tokens // lengths[0]))
        trainer.fit(lit, train_dataloaders=ticks, val_dataloaders=vals, ckpt_path=plan.ckpt_path)
        if trainer.is_global_zero:
            lit.student.eval().float().cpu()
            save(plan.run_dir / "model")
            print(f"fine-tuned {opts.model} for {trainer.global_step} steps, {clock.elapsed_s() / 60:.2f} min "
                  f"({opts.loss}); run {plan.run_dir}, model folder {plan.run_dir / 'model'}")
    finally:
        plan.release()
    return 0


def _clear_distill_run(run_dir: Path) -> None:
    """Remove an earlier distill run's files from ``run_dir``: what :func:`training.rundir.clear_run_files` removes,
    ``curve.csv`` and the model folders (``model/``, ``model-<M>min/``) it wrote."""
    import shutil

    from training.rundir import clear_run_files

    clear_run_files(run_dir)
    (run_dir / "curve.csv").unlink(missing_ok=True)
    for folder in [run_dir / "model", *run_dir.glob("model-*min")]:
        if folder.is_dir() and not folder.is_symlink() and (folder / "config.json").is_file():
            shutil.rmtree(folder)


def _rank_zero() -> bool:
    import os

    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


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
