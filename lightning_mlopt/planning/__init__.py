"""The memory planner behind ``python -m lightning_mlopt plan``."""

from lightning_mlopt.planning.memory import MemoryPlan, PlanRow, parse_count, parse_size, plan_memory

__all__ = ["MemoryPlan", "PlanRow", "parse_count", "parse_size", "plan_memory"]
