"""Pipeline parallelism: schedules as data (schedules.py), simulated and checked (simulator.py),
executed by the runtime (runtime.py), cut by counted cost (partition.py), measured against the
formula (measure.py), drawn (timeline.py)."""
from .schedules import Action, NAMES, SPLIT_BACKWARD, ScheduleError, format_schedule, get_schedule, placement, splits_backward
from .simulator import check_schedule, formula_bubble_fraction, simulate
from .partition import balanced_split_points, implied_bubble
from .runtime import PipelineParallel

__all__ = ["Action", "NAMES", "SPLIT_BACKWARD", "ScheduleError", "check_schedule", "format_schedule",
           "formula_bubble_fraction", "get_schedule", "placement", "simulate", "splits_backward",
           "PipelineParallel", "balanced_split_points", "implied_bubble"]
