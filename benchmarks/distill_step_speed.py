"""Seconds per ``training.distill`` KL step (student forward + loss + backward + AdamW, teacher forward) on the CPU:
the one-pass KL of :mod:`training.distill_loss` against the autograd formula it replaced (log-softmax of both,
``exp``, difference, product, plus a separate cross-entropy for the logged LM loss, and a teacher call that builds a
K/V cache), alternating step by step in one process so both see the same machine load.

    OMP_NUM_THREADS=1 python benchmarks/distill_step_speed.py --model MLA_DIR [--teacher SRC] [--steps 4] \\
        [--batch-size 4] [--seq-len 256]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

if __name__ == "__main__" and not __package__:  # run as a file: the repository first on sys.path (benchmarks/_root.py)
    import _root  # noqa: F401

from benchmarks.harness.options import add_model, command, parser  # noqa: E402
from benchmarks.harness.paths import CALIB, SMOLLM2  # noqa: E402
from benchmarks.harness.timing import wall_time  # noqa: E402


@command
def main(argv=None) -> int:
    ap = parser(__file__, __doc__)
    add_model(ap, help="the MLA student (a to_mla folder)", required=True)
    ap.add_argument("--teacher", default=str(SMOLLM2))
    ap.add_argument("--steps", type=int, default=4, help="steps of each variant (after one warm-up step)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args(argv)
    from kvsplice.loading import iter_texts, load_model, token_stream
    from training.lit_distill import LitDistill, causal_logits

    student, teacher = load_model(args.model), load_model(args.teacher).model
    b, t = args.batch_size, args.seq_len
    ids, _ = token_stream(iter_texts(str(CALIB)), student.tokenizer, (2 * args.steps + 2) * b * (t + 1))
    win = ids[: (ids.numel() // (t + 1)) * (t + 1)].view(-1, t + 1)
    lit = LitDistill(student.model.train(), win, win[:1], teacher=teacher, loss="kl", batch_size=b)
    opt = torch.optim.AdamW(lit.student.parameters(), lr=1e-5)

    def autograd_losses(ids: torch.Tensor) -> dict:  # the formula before training.distill_loss
        x, y = ids[:, :-1], ids[:, 1:]
        logits = causal_logits(lit.student, x).float()
        out = {"lm": F.cross_entropy(logits.flatten(0, 1), y.flatten())}
        with torch.no_grad():
            o = teacher(x)
        lt, ls = torch.log_softmax(o.logits.float(), -1), torch.log_softmax(logits, -1)
        out["kl"] = (lt.exp() * (lt - ls)).sum(-1).mean()
        return out

    def step(s: int, losses) -> float:
        def one() -> None:
            loss = losses(lit._batch(s))["kl"]
            opt.zero_grad()
            loss.backward()
            opt.step()
        return wall_time(one, 1)[0]

    step(0, lit.losses)
    times: dict[str, list[float]] = {"autograd KL (before)": [], "one-pass KL (training.distill_loss)": []}
    for s in range(1, 2 * args.steps + 1):
        name = list(times)[s % 2 == 0]
        times[name].append(step(s, autograd_losses if s % 2 else lit.losses))
    print(f"threads {torch.get_num_threads()}, batch {b} x {t} tokens, {args.model}")
    for name, v in times.items():
        print(f"{name}: {sum(v) / len(v):.2f} s/step (min {min(v):.2f}, {len(v)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
