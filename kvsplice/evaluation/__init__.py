"""Evaluation on held-out text behind ``kvsplice eval-bases``: the shared context (``context``) and one
evaluator per method family (``lowrank``: saved bases, ``online``: fd-online)."""

from kvsplice.evaluation.context import EvalContext, EvalError, load_windows
from kvsplice.evaluation.lowrank import eval_static, evaluate_bases, evaluate_quantised
from kvsplice.evaluation.online import eval_fd_online

__all__ = ["EvalContext", "EvalError", "eval_fd_online", "eval_static", "evaluate_bases", "evaluate_quantised",
           "load_windows"]
