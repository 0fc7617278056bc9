"""Speed of ``kvsplice distill`` on the CPU: training tokens/s of a KL step (student forward + loss + backward + AdamW,
teacher forward) for two variants alternating step by step in one process (so both see the same machine load), and
optionally the teacher's self-text generation in tokens/s (:mod:`training.self_text`, into a fresh cache).

``--compare trainable`` (default): every parameter against ``--trainable attention`` (the attention modules only).
``--compare kl``: the one-pass KL of :mod:`training.distill_loss` against the autograd formula it replaced.

    OMP_NUM_THREADS=2 python benchmarks/distill_step_speed.py --model MLA_DIR [--teacher SRC] [--steps 3] \\
        [--batch-size 1] [--seq-len 1024] [--compare trainable|kl] [--generate N --generate-len 1024]
        [--threads 2]
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.nn.functional as F

if __name__ == "__main__" and not __package__:  # run as a file: the repository first on sys.path (benchmarks/_root.py)
    import _root  # noqa: F401

from benchmarks.harness.options import add_model, command, parser  # noqa: E402
from benchmarks.harness.paths import CALIB, SMOLLM2  # noqa: E402
from benchmarks.harness.timing import wall_time  # noqa: E402


def _generation(teacher, n: int, length: int) -> None:
    from training.self_text import SelfTextOptions, self_text

    opts = SelfTextOptions(tokens=n, sample_len=length)
    with tempfile.TemporaryDirectory() as cache:
        got = self_text(teacher.model, teacher.tokenizer, opts, cache_dir=cache, max_positions=teacher.max_positions,
                        progress=False)
    print(f"self-text generation: {got.generated} tokens in {got.seconds:.1f} s = "
          f"{got.generated / got.seconds:.1f} tokens/s (batch {opts.batch_size}, samples of {opts.sample_len})")


@command
def main(argv=None) -> int:
    ap = parser(__file__, __doc__)
    add_model(ap, help="the MLA student (a to-mla folder)", required=True)
    ap.add_argument("--teacher", default=str(SMOLLM2))
    ap.add_argument("--steps", type=int, default=3, help="steps of each variant (after one warm-up step each)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--compare", choices=("trainable", "kl"), default="trainable")
    ap.add_argument("--generate", type=int, default=0, help="also time the teacher writing N tokens")
    ap.add_argument("--generate-len", type=int, default=1024, help="tokens per generated sample")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvsplice.loading import iter_texts, load_model, token_stream
    from training.distill_data import StepWindows
    from training.lit_distill import LitDistill, attention_only, causal_logits

    student, teacher_loaded = load_model(args.model), load_model(args.teacher)
    teacher = teacher_loaded.model
    if args.generate:
        _generation(teacher_loaded, args.generate, args.generate_len)
    b, t = args.batch_size, args.seq_len
    ids, _ = token_stream(iter_texts(str(CALIB)), student.tokenizer, (2 * args.steps + 4) * b * t + 2)
    lit = LitDistill(student.model.train(), StepWindows(ids, (t,), b * t), ids[None, : t + 1], teacher=teacher,
                     loss="kl")
    params = dict(lit.student.named_parameters())
    attention_only(lit.student)
    attn = [p for p in params.values() if p.requires_grad]
    for p in params.values():
        p.requires_grad_(True)
    opts = {"all": torch.optim.AdamW(params.values(), lr=1e-5), "attention": torch.optim.AdamW(attn, lr=1e-5)}

    def autograd_losses(ids: torch.Tensor) -> dict:  # the formula before training.distill_loss
        x, y = ids[:, :-1], ids[:, 1:]
        logits = causal_logits(lit.student, x).float()
        out = {"lm": F.cross_entropy(logits.flatten(0, 1), y.flatten())}
        with torch.no_grad():
            o = teacher(x)
        lt, ls = torch.log_softmax(o.logits.float(), -1), torch.log_softmax(logits, -1)
        out["kl"] = (lt.exp() * (lt - ls)).sum(-1).mean()
        return out

    if args.compare == "kl":
        variants = {"autograd KL (before)": (autograd_losses, "all"),
                    "one-pass KL (training.distill_loss)": (lit.losses, "all")}
    else:
        variants = {"--trainable all": (lit.losses, "all"), "--trainable attention": (lit.losses, "attention")}

    def step(s: int, name: str) -> float:
        losses, which = variants[name]
        if which == "attention":
            attention_only(lit.student)

        def one() -> None:
            loss = losses(lit._batch(s))["kl"]
            opts[which].zero_grad(set_to_none=True)
            loss.backward()
            opts[which].step()
        try:
            return wall_time(one, 1)[0]
        finally:
            for p in params.values():
                p.requires_grad_(True)

    names = list(variants)
    for i, name in enumerate(names):
        step(i, name)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in names}
    for s in range(2 * args.steps):
        name = names[s % 2]
        times[name].append(step(s + 2, name))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"threads {torch.get_num_threads()}, batch {b} x {t} tokens, load average {load:.1f}, {args.model}")
    for name, v in times.items():
        mean = sum(v) / len(v)
        print(f"{name}: {mean:.2f} s/step = {b * t / mean:.1f} tokens/s (min {min(v):.2f} s, {len(v)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
