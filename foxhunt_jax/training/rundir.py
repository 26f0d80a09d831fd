"""The run directory: config.yaml, metrics.jsonl and TensorBoard event files.

Layout of ``out_dir``::

    config.yaml       the resolved configuration of the run
    metrics.jsonl     one JSON object per epoch (strict JSON: NaN and Inf are written as null)
    tb/               TensorBoard event files (the same scalars, nested keys joined with "/")
    checkpoints/      orbax checkpoints (foxhunt_jax.training.checkpoint)
    report/           summary.json and plots (foxhunt_jax.training.report)

An epoch record is a nested dict of numbers with an integer ``"epoch"``, for example
``{"epoch": 3, "loss": 0.41, "epsilon": 0.8, "val": {"sharpe": 1.2, ...},
"val_buy_and_hold": {...}, "phase_ms": {"experience": 48.0, ...}}``; TensorBoard sees
``loss``, ``val/sharpe``, ``phase_ms/experience`` at step ``epoch``.

Each line is flushed and fsynced as it is written, so a killed run loses at most the line being
written; :func:`read_metrics` skips such a partial last line. On resume, ``truncate_after(e)``
drops the records after the checkpoint epoch ``e`` and hides TensorBoard events from epoch
``e + 1`` on (tensorboardX ``purge_step``), so no epoch appears twice.

Only process 0 of a multi-host run writes; a writer with ``process_index != 0`` does nothing.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from foxhunt_jax.errors import DataError

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"


def to_jsonable(value: Any) -> Any:
    """Nested dicts/lists of NumPy/JAX scalars and arrays -> plain JSON (non-finite -> None)."""
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (str, type(None))):
        return value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # np.ndarray, jax.Array
        arr = np.asarray(value)
        if arr.dtype.kind == "V" and np.dtype(arr.dtype).name in ("bfloat16", "float16"):
            arr = arr.astype(np.float64)  # ml_dtypes floats (bfloat16) are not kind "f"
        if arr.dtype.kind in "biuf":
            return to_jsonable(arr.item() if arr.ndim == 0 else arr.tolist())
    raise TypeError(f"cannot write {type(value).__name__} to JSON: {value!r}")


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"val": {"sharpe": 1}}`` -> ``{"val/sharpe": 1}`` (leaves kept as they are)."""
    out: dict[str, Any] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _drop_partial_line(path: Path) -> None:
    """Cuts an unterminated last line (a write killed midway) so appends start on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())


def _parse_lines(path: Path) -> list[dict]:
    """Complete records of a metrics.jsonl; a partial last line (killed mid-write) is skipped."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    records = []
    # The piece after the last "\n" is "" when the file is complete, else a line whose write
    # never finished: it is left out.
    for i, line in enumerate(lines[:-1]):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise DataError(str(path), "is not valid JSON lines", row=i + 1) from None
    return records


def read_metrics(out_dir: str | os.PathLike) -> list[dict]:
    """Epoch records of a run directory in file order (``[]`` if there are none yet)."""
    return _parse_lines(Path(out_dir) / METRICS_FILE)


class RunWriter:
    """Writes one run directory; see the module docstring for the layout.

    Usage: ``w = RunWriter(out_dir); w.write_config(dump_yaml(cfg)); w.log({"epoch": 1, ...});
    w.close()`` (or ``with RunWriter(out_dir) as w: ...``).
    """

    def __init__(self, out_dir: str | os.PathLike, process_index: int = 0):
        self.out_dir = Path(out_dir)
        self.active = process_index == 0
        self.checkpoint_dir = self.out_dir / "checkpoints"
        self.report_dir = self.out_dir / "report"
        self._metrics = None
        self._tb = None
        self._purge_step: int | None = None
        if self.active:
            for d in (self.out_dir, self.checkpoint_dir, self.report_dir):
                d.mkdir(parents=True, exist_ok=True)

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / METRICS_FILE

    def write_config(self, text: str) -> None:
        """Writes config.yaml (replacing it atomically)."""
        if self.active:
            _write_atomic(self.out_dir / CONFIG_FILE, text)

    def log(self, record: Mapping[str, Any]) -> None:
        """Appends one epoch record to metrics.jsonl (fsynced) and its scalars to TensorBoard."""
        if not self.active:
            return
        rec = to_jsonable(record)
        epoch = rec.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise ValueError(f"an epoch record needs an integer 'epoch', got {epoch!r}")
        if self._metrics is None:
            _drop_partial_line(self.metrics_path)
            self._metrics = open(self.metrics_path, "a")
        self._metrics.write(json.dumps(rec, allow_nan=False) + "\n")
        self._metrics.flush()
        os.fsync(self._metrics.fileno())

        tb = self._writer()
        for key, value in flatten(rec).items():
            if key == "epoch" or isinstance(value, (str, list)) or value is None:
                continue
            tb.add_scalar(key, float(value), global_step=epoch)
        tb.flush()

    def _writer(self):
        if self._tb is None:
            from tensorboardX import SummaryWriter  # imported late: only process 0 needs it

            # Event files are named by the second they were opened: a suffix keeps a writer
            # reopened within the same second (a quick resume) from overwriting the last file.
            self._tb = SummaryWriter(logdir=str(self.out_dir / "tb"), purge_step=self._purge_step,
                                     flush_secs=30, filename_suffix=f".{time.time_ns()}")
        return self._tb

    def truncate_after(self, epoch: int) -> None:
        """On resume from the checkpoint of ``epoch``: drops later records and TensorBoard events.

        Rewrites metrics.jsonl atomically with the records whose epoch is ``<= epoch`` (a partial
        last line is dropped too).
        """
        if not self.active:
            return
        self._close_files()
        kept = [r for r in read_metrics(self.out_dir) if int(r.get("epoch", 0)) <= epoch]
        if self.metrics_path.exists():
            _write_atomic(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        self._purge_step = int(epoch) + 1

    def _close_files(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def close(self) -> None:
        self._close_files()

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["RunWriter", "read_metrics", "to_jsonable", "flatten", "METRICS_FILE", "CONFIG_FILE"]
