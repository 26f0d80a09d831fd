"""Market files for the tests: valid random bars, and CSV files with one planted fault."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from foxhunt_jax.data.loader import MIN_BARS

N_GOOD = MIN_BARS + 25  # bars of a valid random table


def bars_frame(n: int = N_GOOD, seed: int = 0, start: str = "2001-01-01", freq: str = "D",
               adj: bool = False) -> pd.DataFrame:
    """A valid random table of n bars (Date as datetime64)."""
    rng = np.random.default_rng(seed)
    close = 50.0 * np.exp(np.cumsum(0.01 * rng.standard_normal(n)))
    open_ = close * np.exp(0.005 * rng.standard_normal(n))
    high = np.maximum(open_, close) * (1 + 0.01 * rng.random(n))
    low = np.minimum(open_, close) * (1 - 0.01 * rng.random(n))
    frame = pd.DataFrame({
        "Date": pd.date_range(start, periods=n, freq=freq),
        "Open": open_, "High": high, "Low": low, "Close": close,
        "Volume": rng.integers(1, 10_000, n).astype(float),
    })
    if adj:
        frame["Adj Close"] = close * rng.uniform(0.2, 1.0)
    return frame


def write_csv(frame: pd.DataFrame, path: Path, date_format: str | None = "%Y-%m-%d") -> Path:
    out = frame.copy()
    if date_format is not None and pd.api.types.is_datetime64_any_dtype(out["Date"]):
        out["Date"] = out["Date"].dt.strftime(date_format)
    out.to_csv(path, index=False)
    return path


def bad_file(tmp_path, edit) -> Path:
    frame = bars_frame()
    text = frame.assign(Date=frame["Date"].dt.strftime("%Y-%m-%d")).astype(object)
    edit(text)
    path = tmp_path / "bad.csv"
    text.to_csv(path, index=False)
    return path


def set_cell(row: int, col: str, value):
    """Edits 1-based data row ``row``."""
    def edit(frame):
        frame.loc[row - 1, col] = value
    return edit
