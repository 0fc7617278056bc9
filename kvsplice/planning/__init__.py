"""The budget planner's parts: a compression stack as data and the plan file (``spec``), and the search over
token selection × low rank × bits under a byte budget (``search``); ``python -m kvsplice.plan`` is the CLI."""

from kvsplice.planning.spec import PLAN_FORMAT, Plan, PlanError, STORES, Stack

__all__ = ["PLAN_FORMAT", "Plan", "PlanError", "STORES", "Stack"]
