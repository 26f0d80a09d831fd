"""Bars in memory: the hand-off between loading (files, builtin, synthetic) and features."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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


@dataclass(frozen=True)
class MarketData:
    """All instruments of one data source; ``bar_seconds`` is the median bar spacing."""

    instruments: tuple[Instrument, ...]
    bar_seconds: float

    @property
    def bars_per_year(self) -> float:
        """Annualization factor from the bar frequency (252 trading days for daily-or-longer
        bars; calendar-hour based otherwise, 24 * 365 / hours for intraday bars on a 24h market)."""
        day = 86400.0
        if self.bar_seconds >= 0.9 * day:
            return 252.0 * day / max(self.bar_seconds, day)
        return 365.0 * day / self.bar_seconds
