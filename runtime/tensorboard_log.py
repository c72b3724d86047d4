"""Run metrics to TensorBoard (`--tensorboard DIR`), for users who watch runs there rather than in the
JSON-lines log: the same fields as each log record, plus the measured MFU, each scalar with the step and the
wall-clock timestamp. Optional: needs the `tensorboard` package (torch.utils.tensorboard writes the files).
"""

from __future__ import annotations

import time

from autoplan.cost_models.errors import SpecError


class TensorBoardLog:
    """Rank 0's writer; `write(rec)` takes the JSON log's record."""

    def __init__(self, logdir: str, plan):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise SpecError("--tensorboard needs the tensorboard package", "it is not installed",
                            "pip install tensorboard (or autoplan[tensorboard])") from None
        self.plan = plan
        self.writer = SummaryWriter(log_dir=logdir)
        self.writer.add_text("plan", f"{plan.short_hash}: {plan.model.name}, {plan.parallel.to_string()}")

    def measured_mfu(self, step_time_s: float) -> float:
        """Model FLOPs per step are fixed by the plan, so MFU scales as 1/time: the plan's predicted MFU times
        predicted over measured step time (same FLOPs and peak as the plan's own `mfu`)."""
        p = self.plan.prediction
        return p.mfu * p.step_time_s / step_time_s if step_time_s > 0 else 0.0

    def write(self, rec: dict) -> None:
        now = time.time()
        step = int(rec["step"])
        row = {**rec, "measured_mfu": self.measured_mfu(rec["step_time_s"]), "timestamp": now}
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and value is not None:
                self.writer.add_scalar(f"train/{key}", float(value), global_step=step, walltime=now)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
