"""The budget planner's parts: the plan file holding a method spec (``spec``), and the search over specs — token
selection × storage (low rank, bits, any registered store) under a byte budget (``search``); ``kvsplice plan`` is
the CLI."""

from kvsplice.planning.spec import PLAN_FORMAT, PLAN_VERSION, Plan, PlanError, spec_label, stack_to_spec

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "Plan", "PlanError", "spec_label", "stack_to_spec"]
