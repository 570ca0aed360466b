"""Start-up checks of the files the scheduler will open, so a bad one is one line before any process starts."""

from __future__ import annotations

from shuttle.common.config import SchedulerConfig
from shuttle.common.errors import ModelDirError
from shuttle.scheduler.step_cost import StepCostModel


def check_scheduler_files(config: SchedulerConfig) -> None:
    """Load `--step-cost-profile` and open `--step-log` for appending, as the scheduler will.

    Raises:
        ModelDirError: one line naming the flag, the file and what is wrong with it.
    """
    if config.step_cost_profile:
        try:
            StepCostModel.load(config.step_cost_profile)
        except ValueError as exc:  # the message names the file and what is wrong with it
            raise ModelDirError(f"--step-cost-profile: {exc}") from None
    if config.step_log:
        try:
            with open(config.step_log, "a"):
                pass
        except OSError as exc:
            raise ModelDirError(f"--step-log {config.step_log}: {exc.strerror or exc}") from None
