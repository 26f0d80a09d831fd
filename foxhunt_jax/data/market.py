"""Bars in memory: the hand-off between loading (files, builtin, synthetic) and features."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd


WARMUP_BARS = 64  # bars of each instrument spent on feature history (the longest window + margin)
MARKET_BYTES_PER_BAR = 6 * 8  # an Instrument's timestamps and five float64 columns


def split_sizes(rows: int, splits) -> tuple[int, int, int]:
    """Counts of train / validation / test when ``rows`` items in time order are split by the
    fractions ``splits``.

    ``train = round(rows * f0)``, ``validation`` ends at ``round(rows * (f0 + f1))``, test takes
    the rest. Applied to the pooled distinct bar times of all instruments it gives the calendar
    boundaries (:func:`foxhunt_jax.data.features.split_boundaries`).
    """
    b1 = int(round(rows * splits[0]))
    b2 = max(b1, min(int(round(rows * (splits[0] + splits[1]))), rows))
    return b1, b2 - b1, rows - b2


@dataclass(frozen=True)
class Instrument:
    """One instrument's bars, sorted by time, OHLC already adjusted by Adj Close / Close.

    All arrays have shape [n]; prices and volume are float64, timestamps datetime64[ns].
    """

    name: str
    source: str  # the file (or builtin:NAME) the bars came from, for error messages
    timestamps: np.ndarray
    open: np.ndarray
    high: np.ndarray
    low: np.ndarray
    close: np.ndarray
    volume: np.ndarray

    def __len__(self) -> int:
        return int(self.close.shape[0])

    def frame(self) -> pd.DataFrame:
        """The bars as a DataFrame indexed by timestamp: open, high, low, close, volume."""
        return pd.DataFrame({k: np.asarray(getattr(self, k)) for k in
                             ("open", "high", "low", "close", "volume")},
                            index=pd.DatetimeIndex(np.asarray(self.timestamps), name="time"))


@dataclass(frozen=True)
class MarketData:
    """All instruments of one data source.

    ``bar_seconds``: median spacing of consecutive bars (the inferred frequency).
    ``bars_per_year``: bars per calendar year actually observed (total bars over total span,
    pooled over instruments), the annualization factor of every metric: about 252 for US daily
    stocks, about 6,200 for hourly FX with its weekend gaps.
    """

    instruments: tuple[Instrument, ...]
    bar_seconds: float
    bars_per_year: float


def observed_bars_per_year(instruments) -> float:
    year = 365.25 * 86400.0
    bars, span = 0, 0.0
    for ins in instruments:
        if len(ins) >= 2:
            bars += len(ins) - 1
            span += (ins.timestamps[-1] - ins.timestamps[0]) / np.timedelta64(1, "s")
    return float(bars / span * year) if span > 0 else 252.0


def median_bar_seconds(instruments) -> float:
    gaps = [np.diff(ins.timestamps) / np.timedelta64(1, "s") for ins in instruments if len(ins) >= 2]
    return float(np.median(np.concatenate(gaps))) if gaps else 86400.0
