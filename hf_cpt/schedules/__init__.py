"""Precision schedules: named shapes (`shapes`) and the bits and cost of one run (`schedule`)."""

from .schedule import (
    PrecisionSchedule,
    cost_group,
    get_schedule,
    steps_after_delay,
    training_precision,
)
from .shapes import (
    DELAY_PRECISIONS,
    FOLLOW_UP_SCHEDULES,
    ROUNDING_MODES,
    ScheduleShape,
    available_schedules,
    check_schedule_name,
    progressive_shape,
    register_schedule,
    unregister_schedule,
)

__all__ = ["DELAY_PRECISIONS", "FOLLOW_UP_SCHEDULES", "ROUNDING_MODES", "PrecisionSchedule", "ScheduleShape",
    "available_schedules", "check_schedule_name", "cost_group", "get_schedule", "progressive_shape",
    "register_schedule", "steps_after_delay", "training_precision", "unregister_schedule"]
