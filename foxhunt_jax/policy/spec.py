"""What a trained policy expects of its input: the run's normalization statistics, the data
columns it was trained on, and the per-bar inputs built from raw bars (host NumPy).

A run directory holds ``normalization.json`` (written when training starts): the feature names,
the pooled train-split ``norm_mean``/``norm_std`` that
:func:`foxhunt_jax.data.features.build_tables` applied, and the data columns (``volume`` only
when the training data had any). For a run written before that file existed,
:func:`run_statistics` recomputes them from the run's own config and data (deterministic: the
same data gives the same statistics) and warns.

The features of a bar are the run's (``feature_names``, its ``data.features``), computed by
:func:`~foxhunt_jax.data.features.instrument_features` (bars ``t - 64 .. t`` of its instrument at
most) and normalized by :func:`~foxhunt_jax.data.features.normalize`: the training definition,
applied to the bars up to that bar only.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from foxhunt_jax.config import Config
from foxhunt_jax.data.features import (WARMUP, MarketTables, build_tables, instrument_features,
                                       normalize, registered, rolling_sigma)
from foxhunt_jax.data.loader import frame_to_instruments, load_market
from foxhunt_jax.data.market import Instrument, MarketData
from foxhunt_jax.errors import ConfigError, DataError
from foxhunt_jax.files import write_atomic
from foxhunt_jax.training.rundir import STATISTICS_FILE

PRICE_COLUMNS = ("open", "high", "low", "close")


def data_columns(instruments: Sequence[Instrument]) -> list[str]:
    """The bar columns the data carries: OHLC, plus ``volume`` when any bar has a volume
    (the loader fills an absent volume column with zeros)."""
    has_volume = any(np.any(np.asarray(ins.volume) != 0) for ins in instruments)
    return list(PRICE_COLUMNS) + (["volume"] if has_volume else [])


def volume_coverage(instruments: Sequence[Instrument]) -> str:
    """Which instruments carry a volume: ``"all"``, ``"some"`` or ``"none"``."""
    has = [bool(np.any(np.asarray(ins.volume) != 0)) for ins in instruments]
    return "all" if all(has) else ("some" if any(has) else "none")


def statistics_of(tables: MarketTables, market: MarketData) -> dict:
    """The JSON payload of ``normalization.json`` for a run built from ``market``."""
    return {"feature_names": list(tables.feature_names),
            "norm_mean": [float(x) for x in np.asarray(tables.norm_mean, np.float32)],
            "norm_std": [float(x) for x in np.asarray(tables.norm_std, np.float32)],
            "data_columns": data_columns(market.instruments),
            "volume": volume_coverage(market.instruments),
            "instruments": list(tables.instrument_names)}


def write_statistics(run_dir: str | Path, tables: MarketTables, market: MarketData) -> Path:
    """Writes ``run_dir/normalization.json`` (float32 values survive the JSON round trip)."""
    path = Path(run_dir) / STATISTICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(statistics_of(tables, market), indent=1))


def run_statistics(run_dir: str | Path, cfg: Config, warn=None) -> dict:
    """The run's normalization statistics: its ``normalization.json``, or, for a run without
    one, the same numbers recomputed from its config and data (with a warning)."""
    path = Path(run_dir) / STATISTICS_FILE
    if path.is_file():
        try:
            stats = json.loads(path.read_text())
            _ = [stats[k] for k in ("feature_names", "norm_mean", "norm_std", "data_columns")]
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{path}: not a normalization statistics file ({err})") from None
        if list(stats["feature_names"]) != list(cfg.data.features):
            raise ConfigError(f"{run_dir} was trained on features {stats['feature_names']} "
                              f"({path}), its config names {list(cfg.data.features)}")
        return stats
    (warn or _warn)(f"{run_dir} has no {STATISTICS_FILE} (trained before runs stored it); "
                    "recomputing the normalization statistics from the run's config and data")
    market = load_market(cfg.data.source, sort=cfg.data.sort, synthetic=cfg.data.synthetic,
                                 window=cfg.data.window)
    tables = build_tables(market, cfg.data.splits, cfg.env.episode_length,
                          features=cfg.data.features, split_dates=cfg.data.split_dates)
    return statistics_of(tables, market)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def as_instruments(bars, label: str = "bars") -> tuple[Instrument, ...]:
    """Bars as instruments: :class:`MarketData`, a sequence of :class:`Instrument`, or a
    DataFrame in the loader's file layout (time, OHLC, optional volume, optional ticker column;
    one instrument named ``label`` without a ticker column)."""
    if isinstance(bars, MarketData):
        return tuple(bars.instruments)
    if isinstance(bars, Instrument):
        return (bars,)
    if isinstance(bars, pd.DataFrame):
        frame = bars.reset_index(drop=True).copy()
        frame["__row__"] = np.arange(1, len(frame) + 1)
        return tuple(frame_to_instruments(frame, label, stem=label, min_bars=1))
    if isinstance(bars, Sequence) and all(isinstance(b, Instrument) for b in bars):
        return tuple(bars)
    raise ConfigError(f"bars must be a DataFrame, MarketData or Instruments, got "
                      f"{type(bars).__name__}")


def check_data(instruments: Sequence[Instrument], stats: dict, run: str) -> None:
    """DataError when the data cannot feed the run's network: other data columns, or an
    instrument with too few bars for the feature warm-up; ConfigError when the run's features
    are not all defined in this process (a user feature not registered)."""
    known = {f.name for f in registered()}
    missing = [name for name in stats["feature_names"] if name not in known]
    if missing:
        raise ConfigError(f"{run} was trained on features {missing} that this process does not "
                          "define (register user features with "
                          "foxhunt_jax.data.features.register before loading the run)")
    if not instruments:
        raise DataError("bars", "no instrument given")
    # a run trained with and without volume (some instruments) accepts either
    trained = stats.get("volume") or ("all" if "volume" in stats["data_columns"] else "none")
    given = volume_coverage(instruments)
    if trained != "some" and given != trained:
        source = ", ".join(sorted({ins.source for ins in instruments}))
        raise DataError(source, f"the data has columns {data_columns(instruments)} (volume for "
                                f"{given} of its instruments), the run {run} was trained on "
                                f"{stats['data_columns']} (volume for {trained}): the volume "
                                "features would differ")
    for ins in instruments:
        if len(ins) <= WARMUP:
            raise DataError(ins.source, f"instrument {ins.name} has {len(ins)} bars; a decision "
                                        f"needs at least {WARMUP + 1} ({WARMUP} bars of feature "
                                        "warm-up before the decision bar)")


def bar_table(ins: Instrument, stats: dict) -> dict:
    """Every decidable bar of one instrument (from bar ``WARMUP`` on), host arrays [T]:
    ``timestamps``; ``features`` [T, F] normalized float32; ``open``, ``high``, ``low``,
    ``close``, ``sigma`` float32. Row t uses the instrument's bars up to t only."""
    names = list(stats["feature_names"])
    with np.errstate(divide="ignore", invalid="ignore"):
        raw = instrument_features(ins, names)[WARMUP:]
        sigma = rolling_sigma(np.asarray(ins.close, np.float64))[WARMUP:]
    if not np.all(np.isfinite(raw)):
        row, col = (int(v) for v in np.argwhere(~np.isfinite(raw))[0])
        raise DataError(ins.source, f"feature '{names[col]}' is not finite at bar "
                                    f"{row + WARMUP} of instrument {ins.name}")
    out = {"timestamps": np.asarray(ins.timestamps)[WARMUP:].astype("datetime64[ns]"),
           "features": normalize(raw, np.asarray(stats["norm_mean"], np.float32),
                                 np.asarray(stats["norm_std"], np.float32)),
           "sigma": sigma.astype(np.float32)}
    for name in PRICE_COLUMNS:
        out[name] = np.asarray(getattr(ins, name), np.float64)[WARMUP:].astype(np.float32)
    return out


def parse_timestamp(text) -> np.datetime64:
    """A timestamp given by the user (ISO text or datetime-like) as naive datetime64[ns]."""
    try:
        ts = pd.Timestamp(text)
    except (ValueError, TypeError):
        raise ConfigError(f"--at: cannot read '{text}' as a timestamp") from None
    if ts is pd.NaT:
        raise ConfigError(f"--at: cannot read '{text}' as a timestamp")
    if ts.tzinfo is not None:
        ts = ts.tz_convert("UTC").tz_localize(None)
    return np.datetime64(ts.to_datetime64(), "ns")


def truncate_at(ins: Instrument, at: np.datetime64 | None) -> Instrument:
    """The instrument's bars up to ``at`` (its last bar at or before it); all bars when ``at``
    is None. DataError when ``at`` lies outside the instrument's bars."""
    if at is None:
        return ins
    ts = np.asarray(ins.timestamps).astype("datetime64[ns]")
    if at < ts[0] or at > ts[-1]:
        first, last, when = (pd.Timestamp(t) for t in (ts[0], ts[-1], at))
        raise DataError(ins.source, f"--at {when} is outside the bars of instrument {ins.name} "
                                    f"({first} .. {last})")
    n = int(np.searchsorted(ts, at, side="right"))
    cut = lambda a: np.asarray(a)[:n]  # noqa: E731
    return Instrument(name=ins.name, source=ins.source, timestamps=cut(ins.timestamps),
                      open=cut(ins.open), high=cut(ins.high), low=cut(ins.low),
                      close=cut(ins.close), volume=cut(ins.volume))


def tables_at(instruments: Sequence[Instrument], at, stats: dict, run: str) -> list[dict]:
    """Per instrument, :func:`bar_table` of its bars up to ``at`` (default: all), after
    :func:`check_data`; each table also names its ``instrument`` and the data's
    ``data_last_timestamp`` (the instrument's last bar, read or not)."""
    at = None if at is None else parse_timestamp(at)
    cut = tuple(truncate_at(ins, at) for ins in instruments)
    check_data(cut, stats, run)
    return [dict(bar_table(c, stats), instrument=c.name,
                 data_last_timestamp=np.asarray(ins.timestamps)[-1].astype("datetime64[ns]"))
            for ins, c in zip(instruments, cut)]


__all__ = ["tables_at", "STATISTICS_FILE", "data_columns", "volume_coverage", "statistics_of",
           "write_statistics", "run_statistics", "as_instruments", "check_data", "bar_table",
           "parse_timestamp", "truncate_at"]
