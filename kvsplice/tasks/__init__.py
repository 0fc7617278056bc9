"""Long-context tasks generated from a seed (RULER-style: needles in filler / stories / facts, multi-key / value /
query, variable tracking, common words, story QA), scored by exact match, answered through either door in the
query-aware or query-agnostic setting; ``kvsplice eval-tasks`` is the command (docs/tasks.md)."""

from kvsplice.tasks.instance import SETTINGS, TaskInstance, match_score, prompt_ids
from kvsplice.tasks.suite import DEFAULT_TASKS, TASKS, TUNING_SEED0, make_instance, make_instances

__all__ = ["DEFAULT_TASKS", "SETTINGS", "TASKS", "TUNING_SEED0", "TaskInstance", "make_instance", "make_instances",
           "match_score", "prompt_ids"]
