"""Pipeline parallelism: schedules as data (schedules.py), executed by the runtime (runtime.py)."""
from .schedules import (Action, NAMES, ScheduleError, check_schedule, format_schedule, formula_bubble_fraction,
                        get_schedule, simulate)
from .runtime import PipelineParallel, balanced_split_points

__all__ = ["Action", "NAMES", "ScheduleError", "check_schedule", "format_schedule", "formula_bubble_fraction",
           "get_schedule", "simulate", "PipelineParallel", "balanced_split_points"]
