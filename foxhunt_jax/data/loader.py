"""Market files -> validated bars (:class:`~foxhunt_jax.data.market.MarketData`).

Sources are CSV files (also gzip-compressed), Parquet files and ``builtin:NAME``:

- ``builtin:us_stocks_daily``: five US stocks, daily (embedded, see ``builtin/SOURCES.md``);
- ``builtin:eurusd_hourly``: EUR/USD, hourly (embedded);
- ``builtin:synthetic[?key=value&...]``: :func:`foxhunt_jax.data.synthetic.make_synthetic`, where
  the keys are fields of :class:`~foxhunt_jax.config.SyntheticConfig` overriding the config given.

A file holds one instrument (named after the file stem) or several, told apart by a ticker column
(``Ticker``, ``Symbol`` or ``Instrument``). Column names match case-insensitively, ignoring spaces,
underscores and dots: a time column (``Date``, ``Datetime``, ``Time`` or ``Timestamp``), ``Open``,
``High``, ``Low``, ``Close``, optional ``Volume`` (zeros when absent) and optional ``Adj Close``
(``Adj_Close``, ``adjclose``, ...). Where Adj Close exists, Open/High/Low/Close are multiplied by
``Adj Close / Close`` so that splits and dividends do not show as returns.

Every problem raises :class:`~foxhunt_jax.errors.DataError` naming the file, the column and the
row. Rows are 1-based data rows as in the file: row 1 is the first data row after the header
(for Parquet, the first row of the table). Blank lines in a CSV count as rows but are ignored.
Only regular files are read: a directory, FIFO, socket or device is refused before it is opened.
Prices must pass :func:`foxhunt_jax.data.checks.first_price_problem` (finite, within
[1e-15, 1e15], no one-bar Close move beyond a factor 10,000), the rule training applies too.
``builtin:synthetic`` is refused before it is generated when it would not fit in the memory
available (:func:`synthetic_memory_bytes`).
"""

from __future__ import annotations

import gzip
import math
import os
import re
import stat
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import fields
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from foxhunt_jax.config import SyntheticConfig, from_dict, to_dict
from foxhunt_jax.errors import ConfigError, DataError
from foxhunt_jax.data.checks import PRICE_RULE, first_price_problem, require_memory
from foxhunt_jax.data.features import (SplitDates, parse_split_dates, split_bounds,
                                       tables_peak_bytes)
from foxhunt_jax.data.market import (
    MARKET_BYTES_PER_BAR,
    WARMUP_BARS,
    Instrument,
    MarketData,
    median_bar_seconds,
    observed_bars_per_year,
    split_sizes,
)
from foxhunt_jax.data.synthetic import make_synthetic, synthetic_peak_bytes

EPISODE_BARS = 2  # the shortest episode: one step reads bars s and s+1
DEFAULT_SPLITS = (0.70, 0.15, 0.15)
REL_TOL = 1e-9  # rounding tolerated when High/Low must enclose Open/Close

BUILTIN_FILES = {
    "us_stocks_daily": "us_stocks_daily.csv.gz",
    "eurusd_hourly": "eurusd_hourly.csv.gz",
}
BUILTIN_NAMES = (*BUILTIN_FILES, "synthetic")

# role -> accepted column names after _normalize (lower case, no spaces, underscores or dots)
_ALIASES = {
    "time": ("date", "datetime", "time", "timestamp"),
    "open": ("open",),
    "high": ("high",),
    "low": ("low",),
    "close": ("close",),
    "volume": ("volume",),
    "adj_close": ("adjclose",),
    "ticker": ("ticker", "symbol", "instrument"),
}
_REQUIRED = ("time", "open", "high", "low", "close")
_DISPLAY = {"time": "Date", "open": "Open", "high": "High", "low": "Low", "close": "Close"}

# Each family is tried in order; the whole column must parse with ONE format of one family, so a
# day/month ambiguity can never be resolved differently for different rows.
_DATE_FAMILIES = (
    ("ISO (YYYY-MM-DD[ HH:MM[:SS]])", ("ISO8601",)),
    ("M/D/YYYY[ HH:MM[:SS]]",
     ("%m/%d/%Y", "%m/%d/%Y %H:%M", "%m/%d/%Y %H:%M:%S", "%m/%d/%Y %H:%M:%S.%f")),
    ("DD.MM.YYYY[ HH:MM[:SS[.fff]]]",
     ("%d.%m.%Y %H:%M:%S.%f", "%d.%m.%Y %H:%M:%S", "%d.%m.%Y %H:%M", "%d.%m.%Y")),
)
_DATE_FORMATS_TEXT = ", ".join(name for name, _ in _DATE_FAMILIES)
_NS_MIN, _NS_MAX = np.datetime64("1677-09-22", "s"), np.datetime64("2262-04-11", "s")


def split_counts(timestamps: np.ndarray, dates: SplitDates) -> tuple[int, int, int]:
    """Tradable bars of one instrument (``timestamps`` [n], sorted) in the train, validation
    and test windows of the calendar boundaries ``dates``: its first ``WARMUP_BARS`` feed the
    features' history, the rest are cut exactly as training cuts them
    (:func:`foxhunt_jax.data.features.split_bounds`; an instrument with fewer than
    ``env.episode_length + 1`` bars in a window contributes none there)."""
    bounds = split_bounds(np.asarray(timestamps)[WARMUP_BARS:], dates)
    return tuple(b - a + 1 for a, b in bounds)  # type: ignore[return-value]


def min_bars_needed(episode_bars: int = EPISODE_BARS,
                    splits: Sequence[float] = DEFAULT_SPLITS) -> int:
    """Fewest bars an instrument needs: the feature warm-up, then one episode of
    ``episode_bars`` bars in each of train, validation and test."""
    n = WARMUP_BARS + 3 * episode_bars
    while min(split_sizes(n - WARMUP_BARS, splits)) < episode_bars:
        n += 1
    return n


MIN_BARS = min_bars_needed()  # 95 with the defaults


def warn_to_stderr(message: str) -> None:
    """Default ``on_warning`` of :func:`load_market`: one ``warning: ...`` line on stderr."""
    print(f"warning: {message}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Public entry point


def load_market(
    sources: Sequence[str | os.PathLike] | str | os.PathLike,
    *,
    sort: bool = False,
    synthetic: SyntheticConfig | None = None,
    min_bars: int = MIN_BARS,
    on_warning: Callable[[str], None] = warn_to_stderr,
    window: Sequence[str] = (),
) -> MarketData:
    """Loads, validates and merges the instruments of all ``sources``.

    Args:
      sources: file paths (CSV, CSV.gz, Parquet) and/or ``builtin:NAME`` strings; a single
        string is taken as one source.
      sort: sort each instrument's bars by time instead of rejecting unsorted files
        (duplicate timestamps are rejected either way).
      synthetic: the config of ``builtin:synthetic`` (defaults: ``SyntheticConfig()``); query
        parameters in the source string override it.
      min_bars: fewest bars an instrument may have (default ``MIN_BARS``: ``WARMUP_BARS``
        warm-up bars plus one ``EPISODE_BARS``-bar episode in each default split).
      on_warning: called with a one-line message (no ``warning:`` prefix) when an instrument of
        a multi-instrument file is skipped for having fewer than ``min_bars`` bars; the default
        prints ``warning: <message>`` to stderr. A file whose instruments are all too short
        raises instead.
      window: ``data.window`` ``[start, end]``: :func:`window_market` of the loaded market.

    Returns:
      MarketData with instruments in source order (then order of first appearance in a file);
      float64 price/volume arrays [n], datetime64[ns] timestamps [n].

    Raises:
      DataError: a file that cannot be read or fails validation (names file, column, row).
      ConfigError: no sources, an unknown ``builtin:NAME`` or a bad builtin parameter.
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    sources = list(sources)
    if not sources:
        raise ConfigError("no market data source given (need a path or builtin:NAME)")
    instruments: list[Instrument] = []
    seen: dict[str, str] = {}
    for src in sources:
        for ins in _load_source(src, sort=sort, synthetic=synthetic, min_bars=min_bars,
                                on_warning=on_warning):
            if ins.name in seen:
                raise DataError(ins.source, f"instrument '{ins.name}' is already loaded from "
                                            f"{seen[ins.name]}; instrument names must be unique")
            seen[ins.name] = ins.source
            instruments.append(ins)
    market = MarketData(
        instruments=tuple(instruments),
        bar_seconds=median_bar_seconds(instruments),
        bars_per_year=observed_bars_per_year(instruments),
    )
    return window_market(market, window) if len(window) else market


def window_market(market: MarketData, window: Sequence[str]) -> MarketData:
    """The market of the bars with ``start <= time < end`` (``window`` = ``data.window``),
    as if no other bar existed: an instrument left with ``WARMUP_BARS`` bars or fewer (none
    tradable) is dropped, and the frequency and bars per year are those of the bars kept. A
    window that keeps no instrument: DataError."""
    start, end = parse_split_dates(window, "data.window", ("start", "end"))
    kept = []
    for ins in market.instruments:
        ts = np.asarray(ins.timestamps).astype("datetime64[ns]")
        rows = slice(int(np.searchsorted(ts, start, "left")), int(np.searchsorted(ts, end, "left")))
        if rows.stop - rows.start > WARMUP_BARS:
            kept.append(Instrument(ins.name, ins.source, ts[rows],
                                   *(np.asarray(getattr(ins, k))[rows]
                                     for k in ("open", "high", "low", "close", "volume"))))
    if not kept:
        sources = ", ".join(sorted({ins.source for ins in market.instruments})) or "market"
        raise DataError(sources, f"data.window {list(window)!r} keeps more than {WARMUP_BARS} bars "
                                 "(the warm-up) of no instrument")
    return MarketData(instruments=tuple(kept), bar_seconds=median_bar_seconds(kept),
                      bars_per_year=observed_bars_per_year(kept))


def _load_source(src, *, sort, synthetic, min_bars, on_warning) -> list[Instrument]:
    text = os.fspath(src)
    if isinstance(src, str) and text.startswith("builtin:"):
        name, params = _parse_builtin(text)
        if name == "synthetic":
            return _load_synthetic(text, _synthetic_config(text, synthetic or SyntheticConfig(),
                                                           params))
        res = resources.files("foxhunt_jax.data") / "builtin" / BUILTIN_FILES[name]
        with resources.as_file(res) as path:
            return load_file(path, label=f"builtin:{name}", sort=sort, min_bars=min_bars,
                             on_warning=on_warning)
    return load_file(Path(text).expanduser(), sort=sort, min_bars=min_bars,
                     on_warning=on_warning)


def _load_synthetic(text: str, cfg: SyntheticConfig) -> list[Instrument]:
    """``builtin:synthetic``: refused before generating when it would not fit in memory, and
    after when its random walk breaks the price rule."""
    require_memory(synthetic_memory_bytes(cfg),
                   f"{text} ({cfg.instruments} instruments x {cfg.bars} bars, with its feature "
                   f"tables)", ("data.synthetic.bars", "data.synthetic.instruments"))
    instruments = list(make_synthetic(cfg).instruments)
    for ins in instruments:
        problem = first_price_problem(ins.open, ins.high, ins.low, ins.close)
        if problem is not None:
            raise ConfigError(
                f"{text}: instrument {ins.name}, bar {problem.index}: {problem.message} "
                f"({PRICE_RULE}); the random walk of data.synthetic.bars bars with "
                f"data.synthetic.volatility {cfg.volatility:g} drifts too far: reduce either")
    return instruments


_FIXED_BYTES = 1 << 22  # small arrays whose size does not grow with the bars (filter blocks)


def synthetic_memory_bytes(cfg: SyntheticConfig) -> int:
    """Peak host bytes of generating ``builtin:synthetic`` with ``cfg`` and building its
    feature tables (an upper bound: the larger of the two phases' peaks)."""
    bars = cfg.instruments * cfg.bars
    return _FIXED_BYTES + max(synthetic_peak_bytes(cfg),
                              MARKET_BYTES_PER_BAR * bars + tables_peak_bytes(bars, cfg.bars))


def _parse_builtin(text: str) -> tuple[str, dict[str, str]]:
    """``builtin:NAME?k=v&k2=v2`` -> (NAME, {k: v}); ConfigError names what is wrong."""
    body = text[len("builtin:"):]
    name, _, query = body.partition("?")
    if name not in BUILTIN_NAMES:
        raise ConfigError(f"unknown builtin dataset '{name}' in '{text}' "
                          f"(known: {', '.join(BUILTIN_NAMES)})")
    params: dict[str, str] = {}
    if query:
        for part in query.split("&"):
            key, eq, value = part.partition("=")
            if not key or not eq:
                raise ConfigError(f"bad builtin parameter '{part}' in '{text}' "
                                  f"(expected key=value)")
            if key in params:
                raise ConfigError(f"builtin parameter '{key}' given twice in '{text}'")
            params[key] = value
    if params and name != "synthetic":
        raise ConfigError(f"builtin:{name} takes no parameters, got '{query}'")
    return name, params


def _synthetic_config(text: str, base: SyntheticConfig, params: dict[str, str]) -> SyntheticConfig:
    known = {f.name for f in fields(SyntheticConfig)}
    for key in params:
        if key not in known:
            raise ConfigError(f"unknown builtin:synthetic parameter '{key}' in '{text}' "
                              f"(known: {', '.join(sorted(known))})")
    merged = {**to_dict(base), **params}
    try:
        # The one config system parses and range-checks the values.
        return from_dict({"data": {"synthetic": merged}}).data.synthetic
    except ConfigError as e:
        raise ConfigError(f"bad builtin:synthetic parameter in '{text}': {e}") from None


# ---------------------------------------------------------------------------------------------
# One file


def load_file(path: str | os.PathLike, *, label: str | None = None, sort: bool = False,
              min_bars: int = MIN_BARS,
              on_warning: Callable[[str], None] = warn_to_stderr) -> list[Instrument]:
    """Reads and validates one CSV/Parquet file; returns its instruments (see :func:`load_market`).

    ``label`` is the name used in messages and ``Instrument.source`` (default: the path).
    """
    path = Path(path)
    label = label or str(path)
    frame = _read_frame(path, label)
    return frame_to_instruments(frame, label, stem=_stem(path), sort=sort, min_bars=min_bars,
                                on_warning=on_warning)


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".csv", ".parquet", ".pq", ".txt"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
    return name or path.name


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    msg = text[0] if text else type(err).__name__
    return msg if len(msg) <= 160 else msg[:157] + "..."


def _read_frame(path: Path, label: str) -> pd.DataFrame:
    """File -> DataFrame with a 1-based ``__row__`` column; every failure is a DataError."""
    require_regular_file(path, label)
    try:
        # O_NONBLOCK: a path swapped for a FIFO since the check is refused, not waited on
        with open(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise DataError(label, "is no longer a regular file")
            magic = f.read(4)
    except OSError as e:
        raise DataError(label, f"cannot open file: {e.strerror or _short(e)}") from None
    if not magic:
        raise DataError(label, "file is empty")
    is_parquet_name = path.suffix.lower() in (".parquet", ".pq")
    if magic == b"PAR1":
        return _read_parquet(path, label)
    if is_parquet_name:
        raise DataError(label, "not a Parquet file (missing the PAR1 signature)")
    return _read_csv(path, label, gzipped=magic[:2] == b"\x1f\x8b")


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def require_regular_file(path: str | os.PathLike, label: str | None = None) -> None:
    """Raises DataError unless ``path`` (symlinks followed) is an existing regular file, so
    that nothing blocks on a FIFO or reads a device without end. Never opens ``path``."""
    label = label or os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DataError(label, "file not found") from None
    except OSError as e:
        raise DataError(label, f"cannot open file: {e.strerror or _short(e)}") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        raise DataError(label, f"is {kind}, not a CSV or Parquet file")


def _read_parquet(path: Path, label: str) -> pd.DataFrame:
    try:
        frame = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises many types; the user needs one line
        raise DataError(label, f"cannot read Parquet file: {_short(e)}") from None
    if frame.shape[1] == 0:
        raise DataError(label, "file has no columns")
    frame = frame.reset_index(drop=True)
    frame["__row__"] = np.arange(1, len(frame) + 1)
    return frame


def _read_csv(path: Path, label: str, gzipped: bool) -> pd.DataFrame:
    opener = gzip.open if gzipped else open
    try:
        with opener(path, "rb") as f:
            head = f.read(1 << 16)
    except (OSError, EOFError, zlib.error) as e:
        kind = "corrupt gzip file" if gzipped else "cannot read file"
        raise DataError(label, f"{kind}: {getattr(e, 'strerror', None) or _short(e)}") from None
    if not head.strip():
        raise DataError(label, "file is empty")
    if b"\x00" in head:
        raise DataError(label, "not a CSV or Parquet file (binary content)")
    first_line = head.splitlines()[0]
    sep = max((b",", b";", b"\t"), key=first_line.count).decode()
    last_err: Exception | None = None
    for encoding in ("utf-8-sig", "latin-1"):
        try:
            opts = dict(sep=sep, compression="gzip" if gzipped else None, encoding=encoding)
            header = pd.read_csv(path, nrows=0, **opts).columns
            # Time and ticker columns stay text (a ticker "NA" or "007" must survive); prices
            # use the fast C float parser, and a column with any other text falls back to
            # object dtype, whose bad cells the checks report verbatim. Only "" is missing.
            text_roles = _ALIASES["time"] + _ALIASES["ticker"]
            frame = pd.read_csv(
                path, dtype={c: str for c in header if _normalize(c) in text_roles},
                keep_default_na=False, na_values=[""], skip_blank_lines=False,
                low_memory=False, **opts,
            )
            break
        except UnicodeDecodeError as e:
            last_err = e
        except pd.errors.EmptyDataError:
            raise DataError(label, "file is empty") from None
        except (OSError, EOFError, zlib.error) as e:
            kind = "corrupt gzip file" if gzipped else "cannot read file"
            raise DataError(label, f"{kind}: {getattr(e, 'strerror', None) or _short(e)}") from None
        except Exception as e:  # pandas ParserError and friends
            raise DataError(label, f"cannot parse as CSV: {_short(e)}") from None
    else:
        raise DataError(label, f"cannot decode as text: {_short(last_err)}")
    frame["__row__"] = np.arange(1, len(frame) + 1)
    # Blank lines keep their row number but carry no data.
    data_cols = [c for c in frame.columns if c != "__row__"]
    return frame[frame[data_cols].notna().any(axis=1)].reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# Columns, values and validation


def _normalize(name) -> str:
    return re.sub(r"[\s_.\-]", "", str(name)).lower()


def _find_columns(frame: pd.DataFrame, label: str) -> dict[str, str]:
    """role -> actual column name, for every role present."""
    found: dict[str, str] = {}
    for col in frame.columns:
        if col == "__row__":
            continue
        key = _normalize(col)
        for role, names in _ALIASES.items():
            if key in names:
                if role in found:
                    raise DataError(label, f"columns '{found[role]}' and '{col}' both name the "
                                           f"{role.replace('_', ' ')} column; keep one", column=col)
                found[role] = col
    for role in _REQUIRED:
        if role not in found:
            accepted = ", ".join(_ALIASES[role]) if role == "time" else _DISPLAY[role]
            raise DataError(label, f"missing required column (accepted names: {accepted}, "
                                   f"any case)", column=_DISPLAY[role])
    return found


def parse_timestamps(values: pd.Series, label: str, column: str, rows: np.ndarray) -> np.ndarray:
    """A time column -> datetime64[ns] [n], UTC-naive; DataError names the first bad row.

    Strings must all parse with one format of one family in ``_DATE_FAMILIES`` (tried in order);
    timezone-aware stamps are converted to UTC and made naive.
    """
    missing = values.isna().to_numpy()
    if missing.any():
        raise DataError(label, "missing date", column=column, row=int(rows[np.argmax(missing)]))
    if pd.api.types.is_datetime64_any_dtype(values.dtype):
        parsed = values
        if getattr(values.dt, "tz", None) is not None:
            parsed = values.dt.tz_convert("UTC").dt.tz_localize(None)
    else:
        text = values.astype(str).str.strip()
        parsed, best_ok, best = None, -1, None
        for _, formats in _DATE_FAMILIES:
            for fmt in formats:
                try:
                    attempt = pd.to_datetime(text, format=fmt, errors="coerce", utc=True)
                except (ValueError, TypeError, OverflowError):
                    continue
                ok = attempt.notna().to_numpy()
                if ok.all():
                    parsed = attempt
                    break
                if ok.sum() > best_ok:
                    best_ok, best = int(ok.sum()), ok
            if parsed is not None:
                break
        if parsed is None:
            i = int(np.argmin(best)) if best is not None else 0
            raise DataError(label, f"unparseable date '{text.iloc[i]}' (the whole column must use "
                                   f"one format: {_DATE_FORMATS_TEXT})", column=column,
                            row=int(rows[i]))
        parsed = parsed.dt.tz_localize(None)
    arr = parsed.to_numpy()
    as_s = arr.astype("datetime64[s]")
    bad = (as_s < _NS_MIN) | (as_s > _NS_MAX)
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(label, f"date {as_s[i]} is outside the supported range 1678..2261",
                        column=column, row=int(rows[i]))
    return arr.astype("datetime64[ns]")


def _numbers(values: pd.Series) -> np.ndarray:
    if pd.api.types.is_bool_dtype(values.dtype):
        return np.full(len(values), np.nan)
    if pd.api.types.is_numeric_dtype(values.dtype):
        return values.to_numpy(dtype=np.float64, na_value=np.nan)
    # to_numeric itself ignores surrounding whitespace; anything else unparseable becomes NaN
    # and is reported (with its original text) by the price/volume checks.
    return pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)


def _describe(values: pd.Series, i: int) -> str:
    v = values.iloc[i]
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return "an empty value"
    return repr(v) if isinstance(v, str) else str(v)


def _first_bad(
    frame: pd.DataFrame, arrays: dict[str, np.ndarray], label: str, rows: np.ndarray,
    check: Callable[[np.ndarray], np.ndarray], rule: str,
) -> None:
    """Raises for the earliest row (over all given columns) where ``check`` is False."""
    best: tuple[int, str] | None = None
    for col, arr in arrays.items():
        bad = ~check(arr)
        if bad.any():
            i = int(np.argmax(bad))
            if best is None or i < best[0]:
                best = (i, col)
    if best is not None:
        i, col = best
        raise DataError(label, f"{rule}, got {_describe(frame[col], i)}", column=col,
                        row=int(rows[i]))


def _fmt(x: float) -> str:
    return f"{x:.10g}"


def _ts_text(t: np.datetime64) -> str:
    """2001-01-30 or 2001-01-30 10:00:00 (sub-second digits only where present)."""
    text = str(t).replace("T", " ")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text[:10] if text.endswith(" 00:00:00") else text


def frame_to_instruments(
    frame: pd.DataFrame, label: str, *, stem: str, sort: bool = False, min_bars: int = MIN_BARS,
    on_warning: Callable[[str], None] = warn_to_stderr,
) -> list[Instrument]:
    """Validates a raw table (with a 1-based ``__row__`` column) and splits it by instrument."""
    if len(frame) == 0:
        raise DataError(label, "file has a header but no data rows")
    cols = _find_columns(frame, label)
    rows = frame["__row__"].to_numpy()
    time_col = cols["time"]
    ts = parse_timestamps(frame[time_col], label, time_col, rows)

    price_roles = [r for r in ("open", "high", "low", "close", "adj_close") if r in cols]
    prices = {cols[r]: _numbers(frame[cols[r]]) for r in price_roles}
    _first_bad(frame, prices, label, rows, lambda a: np.isfinite(a) & (a > 0),
               "price must be a finite positive number")
    if "volume" in cols:
        volume = _numbers(frame[cols["volume"]])
        _first_bad(frame, {cols["volume"]: volume}, label, rows,
                   lambda a: np.isfinite(a) & (a >= 0), "volume must be a finite number >= 0")
    else:
        volume = np.zeros(len(frame))
    o, h, lo, c = (prices[cols[r]] for r in ("open", "high", "low", "close"))
    _check_ranges(o, h, lo, c, cols, label, rows)
    if "adj_close" in cols:
        factor = prices[cols["adj_close"]] / c
        o, h, lo, c = o * factor, h * factor, lo * factor, c * factor

    if "ticker" in cols:
        tick = frame[cols["ticker"]]
        missing = tick.isna().to_numpy()
        names = tick.astype(str).str.strip()
        empty = missing | (names == "").to_numpy()
        if empty.any():
            raise DataError(label, "missing instrument name", column=cols["ticker"],
                            row=int(rows[np.argmax(empty)]))
        codes, uniques = pd.factorize(names)
        order = np.argsort(codes, kind="stable")
        bounds = np.searchsorted(codes[order], np.arange(len(uniques) + 1))
        groups = [(str(uniques[k]), order[bounds[k]:bounds[k + 1]]) for k in range(len(uniques))]
    else:
        groups = [(stem, np.arange(len(frame)))]

    multi = "ticker" in cols
    out: list[Instrument] = []
    short: list[tuple[str, int]] = []
    for name, idx in groups:
        idx = _order_bars(ts, idx, rows, label, time_col, name if multi else None, sort)
        if len(idx) < min_bars:
            short.append((name, len(idx)))
            continue
        _check_prices(o[idx], h[idx], lo[idx], c[idx], cols, label, rows[idx], name)
        out.append(Instrument(
            name=name, source=label, timestamps=ts[idx],
            open=np.ascontiguousarray(o[idx], dtype=np.float64),
            high=np.ascontiguousarray(h[idx], dtype=np.float64),
            low=np.ascontiguousarray(lo[idx], dtype=np.float64),
            close=np.ascontiguousarray(c[idx], dtype=np.float64),
            volume=np.ascontiguousarray(volume[idx], dtype=np.float64),
        ))
    if not out:
        name, n = max(short, key=lambda s: s[1])
        which = f"instrument {name} has" if multi else "file has"
        raise DataError(label, f"too few bars: {which} {n}, fewer than the {min_bars} needed "
                               f"({WARMUP_BARS} warm-up bars plus one episode in each split)")
    for name, n in short:
        on_warning(f"{label}: instrument {name} has {n} bars, fewer than {min_bars} needed; "
                   f"skipped")
    return out


def _check_ranges(o, h, lo, c, cols, label, rows) -> None:
    """High >= Low and High/Low enclose Open/Close (relative tolerance REL_TOL)."""
    checks = (
        (h < lo, cols["high"], lambda i: f"High {_fmt(h[i])} is below Low {_fmt(lo[i])}"),
        (h < np.maximum(o, c) * (1 - REL_TOL), cols["high"],
         lambda i: f"High {_fmt(h[i])} is below max(Open, Close) = {_fmt(max(o[i], c[i]))}"),
        (lo > np.minimum(o, c) * (1 + REL_TOL), cols["low"],
         lambda i: f"Low {_fmt(lo[i])} is above min(Open, Close) = {_fmt(min(o[i], c[i]))}"),
    )
    for bad, col, message in checks:
        if bad.any():
            i = int(np.argmax(bad))
            raise DataError(label, message(i), column=col, row=int(rows[i]))


def _check_prices(o, h, lo, c, cols, label, rows, name) -> None:
    """The shared price rule on one instrument's bars (in time order, adjusted): DataError at
    the file row and column of the first bar that breaks it."""
    problem = first_price_problem(o, h, lo, c)
    if problem is None:
        return
    adjusted = " after the Adj Close / Close adjustment" if "adj_close" in cols else ""
    raise DataError(label, f"instrument {name}: {problem.message}{adjusted} ({PRICE_RULE})",
                    column=cols[problem.field], row=int(rows[problem.index]))


def _order_bars(ts, idx, rows, label, time_col, name, sort) -> np.ndarray:
    """Row indices of one instrument in time order; rejects unsorted (unless ``sort``) and
    duplicate timestamps."""
    who = f"instrument {name}: " if name is not None else ""
    t = ts[idx]
    back = np.diff(t) < np.timedelta64(0, "ns")
    if back.any():
        if not sort:
            j = int(np.argmax(back))
            raise DataError(
                label, f"{who}timestamps are not sorted: {_ts_text(t[j + 1])} comes after "
                       f"{_ts_text(t[j])} (row {rows[idx[j]]}); sort the file or use --sort "
                       f"(data.sort: true)", column=time_col, row=int(rows[idx[j + 1]]))
        idx = idx[np.argsort(t, kind="stable")]
        t = ts[idx]
    dup = np.diff(t) == np.timedelta64(0, "ns")
    if dup.any():
        j = int(np.argmax(dup))
        raise DataError(
            label, f"{who}duplicate timestamp {_ts_text(t[j + 1])} (same as row {rows[idx[j]]})",
            column=time_col, row=int(rows[idx[j + 1]]))
    return idx


__all__ = [
    "load_market", "window_market", "load_file", "frame_to_instruments",
    "parse_timestamps", "split_counts",
    "min_bars_needed", "warn_to_stderr", "require_regular_file", "synthetic_memory_bytes",
    "MIN_BARS", "WARMUP_BARS", "EPISODE_BARS", "DEFAULT_SPLITS", "BUILTIN_NAMES",
]
