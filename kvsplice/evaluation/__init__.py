"""Evaluation on held-out text behind ``python -m kvsplice.eval_bases``: the shared context (``context``) and one
evaluator per method family (``lowrank``: saved bases, ``online``: fd-online)."""
