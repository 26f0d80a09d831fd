"""Choosing the agent on validation, and early stopping (host-side, from the epoch records).

``train.select_by`` names the validation metric: ``sharpe`` or ``total_return`` of the greedy
validation windows (higher is better) or ``loss``, the validation C51 loss (lower is better);
for a gymnax env, ``return``, the mean return of the greedy validation episodes (higher).
Only validation numbers are read, never the test split's. The first epoch is selected whatever
its value; a later epoch replaces the selection when its value is finite and strictly better
(ties keep the earlier epoch, a NaN never wins). ``train.patience`` > 0 stops a run after that
many epochs in a row without a new selection.

A :class:`Selection` is immutable; its JSON form (:meth:`Selection.to_json`) sits in every
checkpoint's metadata, so a resumed run continues it exactly. Each epoch record carries
:meth:`Selection.record_fields`: ``select_metric``, ``select_value`` (this epoch's value),
``selected_epoch``, ``best_<metric>`` (the selected epoch's value) and ``epochs_since_best``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# metric -> (path in the epoch record, +1 when higher is better, -1 when lower is)
METRICS = {"sharpe": (("val", "sharpe"), 1.0), "total_return": (("val", "total_return"), 1.0),
           "loss": (("val_loss",), -1.0), "return": (("val", "return"), 1.0)}


def metric_value(record: dict, metric: str) -> float:
    """The validation value of ``metric`` in an epoch record (NaN when absent or None)."""
    value = record
    for key in METRICS[metric][0]:
        value = value.get(key) if isinstance(value, dict) else None
    return float("nan") if value is None else float(value)


@dataclass(frozen=True)
class Selection:
    """The selected epoch so far: ``epoch`` 0 before the first record; ``value`` its metric;
    ``stale`` the epochs recorded since it."""

    metric: str
    epoch: int = 0
    value: float = float("nan")
    stale: int = 0

    def better(self, value: float) -> bool:
        """Whether ``value`` replaces the selection."""
        if self.epoch == 0:
            return True
        if not math.isfinite(value):
            return False
        return not math.isfinite(self.value) or METRICS[self.metric][1] * (value - self.value) > 0

    def update(self, record: dict) -> tuple["Selection", bool]:
        """The selection after epoch ``record["epoch"]``, and whether that epoch is selected."""
        value = metric_value(record, self.metric)
        if self.better(value):
            return replace(self, epoch=int(record["epoch"]), value=value, stale=0), True
        return replace(self, stale=self.stale + 1), False

    def stops(self, patience: int) -> bool:
        """Whether ``patience`` (> 0) epochs in a row have passed without a new selection."""
        return patience > 0 and self.stale >= patience

    def record_fields(self, record: dict) -> dict:
        """The selection's keys of an epoch record (after :meth:`update` with that record)."""
        return {"select_metric": self.metric, "select_value": metric_value(record, self.metric),
                "selected_epoch": self.epoch, f"best_{self.metric}": self.value,
                "epochs_since_best": self.stale}

    def to_json(self) -> dict:
        return {"metric": self.metric, "epoch": self.epoch,
                "value": self.value if math.isfinite(self.value) else None, "stale": self.stale}

    @classmethod
    def from_json(cls, data: dict) -> "Selection":
        value = data.get("value")
        return cls(metric=str(data["metric"]), epoch=int(data["epoch"]),
                   value=float("nan") if value is None else float(value),
                   stale=int(data["stale"]))


__all__ = ["Selection", "METRICS", "metric_value"]
