"""Per-bar features, time splits and normalization: MarketData -> MarketTables (host NumPy).

A run's features are the names of the config key ``data.features`` (default
:data:`DEFAULT_FEATURES`, the 34 built-in ones in their historical order), looked up in a
registry: the built-in features below, and any a library user adds with :func:`register`
(docs/features.md). The order of the names is the order of the feature columns, ``F`` their
count.

The no-look-ahead contract: every feature of bar ``t`` is a function of the bars ``<= t`` of its
own instrument only (:func:`check_no_lookahead` tests one feature for it). A feature's
``window`` is the number of bars its value reads, bar ``t`` included; it is at most
``WARMUP + 1``. The first ``WARMUP`` (64) bars of each instrument lack a full history and are
dropped (never traded; they, and every earlier bar, may be read as the history of later
features). The remaining rows are split at one calendar boundary shared by all instruments
(:func:`split_boundaries`): an instrument contributes to a split only its bars inside that
split's window, and none when it has fewer than ``episode_length + 1`` there. Features are
normalized with the mean and std of the train rows of all instruments pooled (so nothing about
validation or test leaks into the train inputs), then clipped to [-10, 10].
Instruments are concatenated into one table so that an episode gathers its row with a single
index.

Built-in features (float64 before normalization; ``r`` = one-bar log return of Close; the
registry holds each one's meaning and window, :func:`registered` lists them):

- ``ret_1`` (the synthetic market plants its signal here), ``ret_2``, ``ret_5``, ``ret_10``,
  ``ret_20``, ``ret_60``: log(C_t / C_{t-n});
- ``ret_1_lag1`` .. ``ret_1_lag4``: r_{t-k};
- ``vol_5``, ``vol_10``, ``vol_20``, ``vol_60``: std (ddof 0) of r over the last n bars;
- ``vol_ratio_5_60``, ``vol_ratio_20_60``: log(vol_n / vol_60) (0 when either is 0);
- ``ret_1_z``: r_t / vol_20 (0 when vol_20 is 0);
- ``bar_pos``: (C - L) / (H - L), 0.5 when H == L; ``bar_range``: log(H / L);
  ``bar_body``: log(C / O); ``upper_wick``: log(H / max(O, C)); ``lower_wick``: log(min(O, C) / L);
  ``gap``: log(O_t / C_{t-1});
- ``range_pos_20``, ``range_pos_60``: (C - min L) / (max H - min L) over the last n bars, 0.5
  when the range is empty;
- ``range_vol_20``: mean of log(H / L) over 20 bars;
- ``high_dist_60``: log(C / max H over 60 bars), ``low_dist_60``: log(C / min L over 60 bars);
- ``volume_z_20``, ``volume_z_60``: z-score of log(1 + V_t) against the last n bars (0 when
  the std is 0, for instance when an instrument has no volume);
- ``ma_gap_5``, ``ma_gap_10``, ``ma_gap_20``, ``ma_gap_50``: log(C / SMA_n(C)).

``sigma[t]`` (barrier width, not normalized) is the std (ddof 0) of r over the 20 bars ending at
t, floored at 1e-4. ``last_log_return[t]`` is the raw r_t (for the oracle and buy-and-hold).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from foxhunt_jax.errors import ConfigError, DataError
from foxhunt_jax.data.checks import PRICE_RULE, first_price_problem
from foxhunt_jax.data.market import WARMUP_BARS, Instrument, MarketData, split_sizes

WARMUP = WARMUP_BARS  # bars dropped per instrument: the longest window (61 closes) plus margin
MAX_WINDOW = WARMUP + 1  # the first kept bar (index WARMUP) has WARMUP + 1 bars up to it
SPLITS = ("train", "validation", "test")
SIGMA_WINDOW = 20
SIGMA_FLOOR = 1e-4
STD_FLOOR = 1e-8
CLIP = 10.0
_CHUNK = 1 << 15  # rows per block in rolling reductions, bounds the [rows, window] temporaries
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")  # no glob characters: a name never is a pattern

# name: (window in bars, bar t included; one-line meaning). The order is DEFAULT_FEATURES'.
_BUILTIN: dict[str, tuple[int, str]] = {
    **{f"ret_{n}": (n + 1, f"log(C_t / C_(t-{n})): the {n}-bar log return")
       for n in (1, 2, 5, 10, 20, 60)},
    **{f"ret_1_lag{k}": (k + 2, f"r_(t-{k}): the one-bar log return of bar t-{k}")
       for k in (1, 2, 3, 4)},
    **{f"vol_{n}": (n + 1, f"std (ddof 0) of the one-bar log returns over {n} bars")
       for n in (5, 10, 20, 60)},
    **{f"vol_ratio_{n}_60": (61, f"log(vol_{n} / vol_60), 0 when either is 0") for n in (5, 20)},
    "ret_1_z": (21, "r_t / vol_20, 0 when vol_20 is 0"),
    "bar_pos": (1, "(C - L) / (H - L), 0.5 when H == L: where the bar closed in its range"),
    "bar_range": (1, "log(H / L)"),
    "bar_body": (1, "log(C / O)"),
    "upper_wick": (1, "log(H / max(O, C))"),
    "lower_wick": (1, "log(min(O, C) / L)"),
    "gap": (2, "log(O_t / C_(t-1)): the opening gap"),
    **{f"range_pos_{n}": (n, f"(C - min L) / (max H - min L) over {n} bars, 0.5 when "
                             "max H == min L") for n in (20, 60)},
    "range_vol_20": (20, "mean of log(H / L) over 20 bars"),
    "high_dist_60": (60, "log(C / max H over 60 bars)"),
    "low_dist_60": (60, "log(C / min L over 60 bars)"),
    **{f"volume_z_{n}": (n, f"z-score of log(1 + V_t) against {n} bars, 0 when their std is 0")
       for n in (20, 60)},
    **{f"ma_gap_{n}": (n, f"log(C / SMA_{n}(C)): distance to the {n}-bar moving average")
       for n in (5, 10, 20, 50)},
}

DEFAULT_FEATURES: tuple[str, ...] = tuple(_BUILTIN)


@dataclass(frozen=True)
class Feature:
    """One registered feature. ``fn(bars) -> [n]`` maps an instrument's bars (an
    :class:`~foxhunt_jax.data.market.Instrument`, oldest first) to one float per bar, the value
    at bar t from bars <= t only; ``window``: the bars a value reads, bar t included (values
    before bar ``window - 1`` may be NaN); ``builtin``: defined by this module."""

    name: str
    window: int
    meaning: str
    fn: Callable[[Instrument], np.ndarray]
    builtin: bool


@dataclass(frozen=True)
class MarketTables:
    """Host arrays of all instruments concatenated; ``T`` rows, ``F`` features.

    features [T, F] float32 (normalized with train statistics, clipped to [-10, 10]);
    open, high, low, close, sigma, last_log_return [T] float32; instrument [T] int32;
    timestamps [T] datetime64[ns];
    segments[split] int64 [n_instruments, 2]: first and last global row of that split of each
    instrument, inclusive (an empty segment has last = first - 1: the instrument has fewer than
    ``episode_length + 1`` bars in that split's calendar window);
    starts[split] int32 [S]: valid episode starts (bars s .. s + episode_length in one segment);
    feature_names [F]: the registered features of the columns, in order;
    norm_mean, norm_std float32 [F]: the statistics applied (train rows only).
    """

    features: np.ndarray
    open: np.ndarray
    high: np.ndarray
    low: np.ndarray
    close: np.ndarray
    sigma: np.ndarray
    last_log_return: np.ndarray
    instrument: np.ndarray
    timestamps: np.ndarray
    segments: dict
    starts: dict
    feature_names: tuple
    norm_mean: np.ndarray
    norm_std: np.ndarray
    instrument_names: tuple
    bar_seconds: float
    bars_per_year: float
    episode_length: int
    split_dates: SplitDates | None = None  # the calendar boundaries the segments were cut at

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])


# ---------------------------------------------------------------------------------------------
# Causal rolling windows: entry t reduces x[t - n + 1 .. t]; entries t < n - 1 are NaN.


def _rolling(x: np.ndarray, n: int, reduce) -> np.ndarray:
    """[m] -> [m]; ``reduce(windows [rows, n]) -> [rows]`` applied block by block."""
    out = np.full(x.shape[0], np.nan)
    if x.shape[0] < n:
        return out
    win = np.lib.stride_tricks.sliding_window_view(x, n)
    for a in range(0, win.shape[0], _CHUNK):
        out[n - 1 + a: n - 1 + a + _CHUNK] = reduce(win[a: a + _CHUNK])
    return out


def _mean(x, n):
    return _rolling(x, n, lambda w: w.mean(axis=1))


def _std(x, n):
    return _rolling(x, n, lambda w: w.std(axis=1))


def _max(x, n):
    return _rolling(x, n, lambda w: w.max(axis=1))


def _min(x, n):
    return _rolling(x, n, lambda w: w.min(axis=1))


def _lag(x: np.ndarray, k: int) -> np.ndarray:
    """x[t - k] at t; NaN for t < k."""
    out = np.full_like(x, np.nan)
    if k < x.shape[0]:
        out[k:] = x[: x.shape[0] - k]
    return out


def _safe_div(num, den, fill):
    """num / den where den > 0, else ``fill`` (NaN inputs stay NaN)."""
    ok = den > 0
    return np.where(ok, num / np.where(ok, den, 1.0), np.where(np.isnan(den), np.nan, fill))


def log_returns(close: np.ndarray) -> np.ndarray:
    """[m] closes -> [m] one-bar log returns, NaN at t = 0."""
    r = np.full(close.shape[0], np.nan)
    r[1:] = np.log(close[1:] / close[:-1])
    return r


def rolling_sigma(close: np.ndarray) -> np.ndarray:
    """[m] -> [m]: std of one-bar log returns over the 20 bars ending at t, floored at 1e-4."""
    return np.maximum(_std(log_returns(close), SIGMA_WINDOW), SIGMA_FLOOR)



def builtin_columns(bars) -> dict[str, np.ndarray]:
    """Every built-in feature of one instrument, raw (un-normalized): name -> [n] float64.

    ``bars`` has ``open``, ``high``, ``low``, ``close``, ``volume`` arrays [n], oldest first.
    Row t uses bars <= t only; rows t < window - 1 hold NaN.
    """
    o, h, lo, c = (np.asarray(a, np.float64) for a in (bars.open, bars.high, bars.low, bars.close))
    v = np.asarray(bars.volume, np.float64)
    logc = np.log(c)
    r = log_returns(c)
    cols: dict[str, np.ndarray] = {}
    for n in (1, 2, 5, 10, 20, 60):
        cols[f"ret_{n}"] = logc - _lag(logc, n)
    for k in (1, 2, 3, 4):
        cols[f"ret_1_lag{k}"] = _lag(r, k)
    vol = {n: _std(r, n) for n in (5, 10, 20, 60)}
    for n, s in vol.items():
        cols[f"vol_{n}"] = s
    for n in (5, 20):
        ok = (vol[n] > 0) & (vol[60] > 0)
        ratio = np.log(np.where(ok, vol[n], 1.0) / np.where(ok, vol[60], 1.0))
        cols[f"vol_ratio_{n}_60"] = np.where(np.isnan(vol[60] + vol[n]), np.nan, ratio)
    cols["ret_1_z"] = _safe_div(r, vol[20], 0.0)
    cols["bar_pos"] = _safe_div(c - lo, h - lo, 0.5)
    bar_range = np.log(h / lo)
    cols["bar_range"] = bar_range
    cols["bar_body"] = np.log(c / o)
    cols["upper_wick"] = np.log(h / np.maximum(o, c))
    cols["lower_wick"] = np.log(np.minimum(o, c) / lo)
    cols["gap"] = np.log(o / _lag(c, 1))
    hi = {n: _max(h, n) for n in (20, 60)}
    lw = {n: _min(lo, n) for n in (20, 60)}
    for n in (20, 60):
        cols[f"range_pos_{n}"] = _safe_div(c - lw[n], hi[n] - lw[n], 0.5)
    cols["range_vol_20"] = _mean(bar_range, 20)
    cols["high_dist_60"] = logc - np.log(hi[60])
    cols["low_dist_60"] = logc - np.log(lw[60])
    lv = np.log1p(np.maximum(v, 0.0))
    for n in (20, 60):
        cols[f"volume_z_{n}"] = _safe_div(lv - _mean(lv, n), _std(lv, n), 0.0)
    for n in (5, 10, 20, 50):
        cols[f"ma_gap_{n}"] = logc - np.log(_mean(c, n))
    return cols


def _builtin_column(name: str, bars) -> np.ndarray:
    return builtin_columns(bars)[name]


# ---------------------------------------------------------------------------------------------
# The registry: built-in features first, then user ones in the order they were registered.

_REGISTRY: dict[str, Feature] = {
    name: Feature(name, window, meaning, functools.partial(_builtin_column, name), True)
    for name, (window, meaning) in _BUILTIN.items()}


def register(name: str, fn: Callable[[Instrument], np.ndarray], window: int,
             meaning: str = "") -> Feature:
    """Adds a user feature that ``data.features`` may then name (register it before the config
    is loaded, in every process that trains, evaluates or acts on a run that uses it).

    ``fn(bars)``: ``bars`` is one instrument's :class:`~foxhunt_jax.data.market.Instrument`
    (``open``, ``high``, ``low``, ``close``, ``volume`` float64 arrays [n], ``timestamps``,
    oldest first; ``bars.frame()`` gives them as a pandas DataFrame; read-only) and the result
    is one float per bar ([n]), the value at bar t computed from bars <= t only
    (:func:`check_no_lookahead` tests it). ``window``: bars a value reads, bar t included,
    1 .. ``MAX_WINDOW`` (65); values from bar ``window - 1`` on must be finite on valid bars.
    ConfigError for a taken or malformed name, a window out of range or a non-callable ``fn``.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"feature name {name!r} must be a letter followed by letters, digits "
                          "or underscores")
    if name in _REGISTRY:
        kind = "built-in" if _REGISTRY[name].builtin else "registered"
        raise ConfigError(f"feature '{name}' is already {kind} (unregister a user feature first)")
    if not callable(fn):
        raise ConfigError(f"feature '{name}': fn must be callable, got {type(fn).__name__}")
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or not (
            1 <= window <= MAX_WINDOW):
        raise ConfigError(f"feature '{name}': window must be an integer in 1..{MAX_WINDOW} "
                          f"(the {WARMUP}-bar warm-up plus the bar itself), got {window!r}")
    feat = Feature(name, int(window), str(meaning), fn, False)
    _REGISTRY[name] = feat
    return feat


def unregister(name: str) -> None:
    """Removes a user feature (ConfigError for a built-in or unknown name)."""
    if name not in _REGISTRY or _REGISTRY[name].builtin:
        raise ConfigError(f"'{name}' is not a registered user feature")
    del _REGISTRY[name]


def registered() -> tuple[Feature, ...]:
    """Every feature ``data.features`` may name: the built-in ones, then the user ones."""
    return tuple(_REGISTRY.values())


def feature(name: str) -> Feature:
    """The registered feature ``name`` (ConfigError listing the choices when there is none)."""
    return _REGISTRY[resolve_features([name], "features")[0]]


def resolve_features(entries: Sequence[str], where: str = "config key 'data.features'"
                     ) -> tuple[str, ...]:
    """Feature names and glob patterns (``vol_*``; a pattern expands to every registered name
    it matches, in registry order) -> the names, in order. ConfigError starting with ``where``
    for an empty list, an unknown name, a pattern that matches nothing, or a name given twice."""
    if isinstance(entries, str):
        entries = [entries]
    out: list[str] = []
    for entry in entries:
        if any(ch in entry for ch in "*?["):
            found = [n for n in _REGISTRY if fnmatch.fnmatchcase(n, entry)]
        else:
            found = [entry] if entry in _REGISTRY else []
        if not found:
            what = "pattern" if any(ch in entry for ch in "*?[") else "feature"
            raise ConfigError(f"{where}: unknown {what} '{entry}' (choices: "
                              f"{', '.join(_REGISTRY)}; user features need "
                              "foxhunt_jax.data.features.register first)")
        for name in found:
            if name in out:
                raise ConfigError(f"{where} names feature '{name}' twice")
            out.append(name)
    if not out:
        raise ConfigError(f"{where} must name at least one feature")
    return tuple(out)


def _read_only(ins: Instrument) -> Instrument:
    """The instrument with float64 read-only views of its columns (a user function may not
    write into the bars the tables are built from)."""
    def view(a, dtype):
        out = np.asarray(a, dtype).view()
        out.flags.writeable = False
        return out
    cols = {k: view(getattr(ins, k), np.float64) for k in ("open", "high", "low", "close",
                                                          "volume")}
    return Instrument(ins.name, ins.source, view(ins.timestamps, "datetime64[ns]"), **cols)


def _user_column(feat: Feature, ins: Instrument) -> np.ndarray:
    n = len(ins)
    values = np.asarray(feat.fn(_read_only(ins)), np.float64)
    if values.shape != (n,):
        raise ConfigError(f"feature '{feat.name}' returned shape {values.shape} for {n} bars, "
                          f"expected ({n},)")
    return values


def instrument_features(ins: Instrument, names: Sequence[str] = DEFAULT_FEATURES) -> np.ndarray:
    """Raw (un-normalized) features ``names`` of one instrument: [n] bars -> [n, F] float64.

    Row t uses bars <= t only; rows t < WARMUP may hold NaN (dropped by build_tables).
    """
    feats = [_REGISTRY[name] for name in resolve_features(names, "features")]
    builtin = builtin_columns(ins) if any(f.builtin for f in feats) else {}
    return np.stack([builtin[f.name] if f.builtin else _user_column(f, ins) for f in feats],
                    axis=1)


# ---------------------------------------------------------------------------------------------
# The no-look-ahead check


class LookAheadError(AssertionError):
    """A feature whose past values change when later bars change (or are absent)."""


def random_bars(n: int = 300, seed: int = 0, name: str = "random") -> Instrument:
    """A geometric random walk of ``n`` daily bars with consistent OHLC and positive volume."""
    rng = np.random.default_rng(seed)
    r = rng.normal(0.0002, 0.01, n)
    close = 100.0 * np.exp(np.cumsum(r))
    prev = np.concatenate([[close[0] * np.exp(-r[0])], close[:-1]])
    open_ = prev * np.exp(rng.normal(0, 0.0025, n))
    high = np.maximum(open_, close) * np.exp(np.abs(rng.normal(0, 0.005, n)))
    low = np.minimum(open_, close) * np.exp(-np.abs(rng.normal(0, 0.005, n)))
    stamps = np.datetime64("2001-01-01", "ns") + np.arange(n) * np.timedelta64(1, "D")
    return Instrument(name, f"random:{seed}", stamps, open_, high, low, close,
                      rng.lognormal(12, 0.5, n))


def _new_future(ins: Instrument, t: int, rng: np.random.Generator) -> Instrument:
    """``ins`` with bars t+1.. replaced by another walk (other level, volatility and volume)."""
    cols = {k: np.array(getattr(ins, k), np.float64) for k in ("open", "high", "low", "close",
                                                               "volume")}
    m = len(ins) - t - 1
    close = cols["close"][t] * 1.5 * np.exp(np.cumsum(rng.normal(0, 0.03, m)))
    open_ = close * np.exp(rng.normal(0, 0.01, m))
    cols["close"][t + 1:], cols["open"][t + 1:] = close, open_
    cols["high"][t + 1:] = np.maximum(open_, close) * 1.02
    cols["low"][t + 1:] = np.minimum(open_, close) * 0.98
    cols["volume"][t + 1:] = rng.lognormal(14, 1.0, m)
    return Instrument(ins.name, ins.source, ins.timestamps, **cols)


def _cut(ins: Instrument, t: int) -> Instrument:
    """``ins`` up to bar t, inclusive."""
    cols = {k: np.asarray(getattr(ins, k))[: t + 1] for k in ("timestamps", "open", "high",
                                                             "low", "close", "volume")}
    return Instrument(ins.name, ins.source, **cols)


def check_no_lookahead(name: str, bars: Instrument | None = None, cuts: int = 6,
                       seed: int = 0) -> None:
    """Tests the registered feature ``name`` for the no-look-ahead contract on ``bars``
    (default :func:`random_bars`): at ``cuts`` bars t (the first one ``window - 1``), its values
    at bars <= t must be bit-identical when bars t+1.. are replaced by others and when they are
    absent, and they must be finite from bar ``window - 1`` on.

    Raises :class:`LookAheadError` naming the feature and the first bar that differs.
    """
    feat = feature(name)
    ins = random_bars(seed=seed) if bars is None else bars
    n = len(ins)
    if n < feat.window + 2:
        raise ConfigError(f"check_no_lookahead: {n} bars, feature '{name}' needs at least "
                          f"{feat.window + 2}")
    column = lambda b: instrument_features(b, (name,))[:, 0]  # noqa: E731
    with np.errstate(divide="ignore", invalid="ignore"):
        base = column(ins)
    bad = np.flatnonzero(~np.isfinite(base[feat.window - 1:]))
    if bad.size:
        raise LookAheadError(f"feature '{name}' is not finite at bar {feat.window - 1 + bad[0]} "
                             f"(window {feat.window}: values from bar {feat.window - 1} on must "
                             "be finite)")
    rng = np.random.default_rng(seed + 1)
    first = feat.window - 1
    points = sorted({first, *(int(t) for t in rng.integers(first, n - 1, max(cuts - 1, 0)))})
    for t in points:
        for how, other in (("replaced", _new_future(ins, t, rng)), ("absent", _cut(ins, t))):
            with np.errstate(divide="ignore", invalid="ignore"):
                got = column(other)[: t + 1]
            same = (got == base[: t + 1]) | (np.isnan(got) & np.isnan(base[: t + 1]))
            if not np.all(same):
                k = int(np.flatnonzero(~same)[0])
                raise LookAheadError(
                    f"feature '{name}' looks ahead: its value at bar {k} changes from "
                    f"{float(base[k])!r} to {float(got[k])!r} when the bars after bar {t} "
                    f"are {how}")


# ---------------------------------------------------------------------------------------------


def tables_peak_bytes(total_bars: int, largest_instrument_bars: int,
                      num_features: int = len(DEFAULT_FEATURES), num_user: int = 0) -> int:
    """Upper bound of the host bytes :func:`build_tables` holds at its peak for a market of
    ``total_bars`` bars whose largest instrument has ``largest_instrument_bars``, with
    ``num_features`` features, ``num_user`` of them user features (none holding more memory
    than its own column).

    Kept for every bar: the raw float64 and normalized float32 features, the float64 and
    float32 prices, sigma and last return in float64 and float32, instrument and timestamp
    (twice). Held for the one instrument being built: every built-in column, the user columns,
    their stacked copy and about 16 float64 intermediates (windows, logs, returns).
    """
    f = int(num_features)
    per_bar = f * 8 + f * 4 + 4 * 8 + 4 * 4 + 2 * 8 + 2 * 4 + 2 * 4 + 2 * 8
    per_instrument_bar = (len(DEFAULT_FEATURES) + int(num_user) + f) * 8 + 16 * 8
    return per_bar * int(total_bars) + per_instrument_bar * int(largest_instrument_bars)


def _check_args(splits, episode_length) -> None:
    if len(splits) != 3 or any(not (s > 0) for s in splits) or abs(sum(splits) - 1) > 1e-6:
        raise ConfigError(f"data.splits must be three positive fractions summing to 1, "
                          f"got {splits!r}")
    if int(episode_length) != episode_length or episode_length < 1:
        raise ConfigError(f"env.episode_length must be an integer >= 1, got {episode_length!r}")


@dataclass(frozen=True)
class SplitDates:
    """One calendar boundary between the splits, the same for every instrument.

    A bar at time ``ts`` is train when ``ts < validation_start``, validation when
    ``validation_start <= ts < test_start``, test when ``ts >= test_start``. ``rule`` says how
    the boundaries were found (for ``data check`` and the logs).
    """

    validation_start: np.datetime64  # datetime64[ns]
    test_start: np.datetime64  # datetime64[ns]
    rule: str


def parse_split_dates(dates, key: str = "data.split_dates",
                      names: tuple[str, str] = ("validation_start", "test_start")
                      ) -> tuple[np.datetime64, np.datetime64]:
    """``data.split_dates`` ``[validation_start, test_start]`` (or another ``key`` holding two
    increasing times ``names``) as datetime64[ns]; ConfigError unless there are two, both parse
    and the first is earlier."""
    pair = f"[{names[0]}, {names[1]}]"
    if len(dates) != 2:
        raise ConfigError(f"config key '{key}' must be empty or two dates {pair}, "
                          f"got {list(dates)!r}")
    try:
        first, second = (np.datetime64(str(d).strip(), "ns") for d in dates)
    except ValueError:
        raise ConfigError(f"config key '{key}' must hold ISO dates such as "
                          f"2012-01-01, got {list(dates)!r}") from None
    if np.isnat(first) or np.isnat(second) or not first < second:
        raise ConfigError(f"config key '{key}' needs {names[0]} < {names[1]}, "
                          f"got {list(dates)!r}")
    return first, second


def split_boundaries(market: MarketData, splits=(0.7, 0.15, 0.15), dates=()) -> SplitDates:
    """The calendar boundaries of the splits.

    With ``dates`` (``data.split_dates``) they are those two times. Otherwise the fractions
    ``splits`` are applied to the sorted distinct times of every instrument's tradable bars
    (those after its ``WARMUP`` warm-up bars), pooled: with ``U`` such times, train holds the
    first ``round(U * f0)``, validation starts at the next one and test at distinct time number
    ``round(U * (f0 + f1))`` (:func:`~foxhunt_jax.data.market.split_sizes`). Only timestamps are
    read, never prices.
    """
    if len(dates):
        first, second = parse_split_dates(dates)
        return SplitDates(first, second, "data.split_dates")
    stamps = [np.asarray(ins.timestamps[WARMUP:]).astype("datetime64[ns]")
              for ins in market.instruments]
    times = np.unique(np.concatenate(stamps)) if stamps else np.array([], "datetime64[ns]")
    if times.size < 3:
        sources = ", ".join(sorted({ins.source for ins in market.instruments})) or "market"
        raise DataError(sources, f"{times.size} distinct bar times after the {WARMUP}-bar "
                        "warm-up; three splits need at least 3")
    train, val, _ = split_sizes(times.size, splits)
    last = times.size - 1
    return SplitDates(times[min(train, last)], times[min(train + val, last)],
                      f"fractions {','.join(f'{f:g}' for f in splits)} of the {times.size} "
                      f"distinct bar times after each instrument's {WARMUP}-bar warm-up")


def _moment_text(t: np.datetime64) -> str:
    """``2012-01-03`` at midnight, else ``2012-01-03 14:00:00``."""
    return str(t.astype("datetime64[s]")).replace("T00:00:00", "").replace("T", " ")


def window_text(dates: SplitDates, split: str) -> str:
    """The calendar window of ``split`` in words, e.g. ``from 2012-01-03 to before 2012-07-02``."""
    v, t = _moment_text(dates.validation_start), _moment_text(dates.test_start)
    return {"train": f"before {v}", "validation": f"from {v} to before {t}",
            "test": f"from {t}"}[split]


def split_bounds(timestamps: np.ndarray, dates: SplitDates, min_rows: int = 1
                 ) -> list[tuple[int, int]]:
    """Local [first, last] (inclusive) rows of train/validation/test of one instrument whose
    tradable bars have the sorted ``timestamps`` [rows], cut at the calendar ``dates``.

    A split with fewer than ``min_rows`` rows is left empty (``last = first - 1``): the
    instrument contributes none of its bars there.
    """
    ts = np.asarray(timestamps).astype("datetime64[ns]")
    b1, b2 = (int(np.searchsorted(ts, d, side="left"))
              for d in (dates.validation_start, dates.test_start))
    bounds = [(0, b1 - 1), (b1, b2 - 1), (b2, ts.size - 1)]
    return [(a, b) if b - a + 1 >= min_rows else (a, a - 1) for a, b in bounds]


def _train_stats(raw: list, train: list) -> tuple[np.ndarray, np.ndarray]:
    """Pooled mean and std (ddof 0, floored) of the train rows, two passes over instruments.

    raw: per-instrument [n_i, F] float64; train: per-instrument local (first, last) inclusive.
    Returns float32 [F] each; these rounded values are the ones applied.
    """
    parts = [x[a: b + 1] for x, (a, b) in zip(raw, train) if b >= a]
    count = sum(len(x) for x in parts)
    mean = sum(x.sum(axis=0) for x in parts) / count
    var = sum(((x - mean) ** 2).sum(axis=0) for x in parts) / count
    return mean.astype(np.float32), np.maximum(np.sqrt(var), STD_FLOOR).astype(np.float32)


def normalize(raw: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Raw features [..., F] -> float32 ``clip((raw - mean) / std, -10, 10)``, computed in
    float64 with the float32 statistics ``mean``, ``std`` [F] (the training run's)."""
    m64 = np.asarray(mean, np.float32).astype(np.float64)
    s64 = np.asarray(std, np.float32).astype(np.float64)
    return np.clip((np.asarray(raw, np.float64) - m64) / s64, -CLIP, CLIP).astype(np.float32)


def build_tables(market: MarketData, splits=(0.7, 0.15, 0.15), episode_length: int = 100,
                 features: Sequence[str] = DEFAULT_FEATURES, split_dates=()) -> MarketTables:
    """Features ``features`` (registered names or patterns, :func:`resolve_features`),
    splits, normalization and valid starts of all instruments (see module doc).

    ``splits`` and ``split_dates`` (``data.splits``, ``data.split_dates``) give the calendar
    boundaries (:func:`split_boundaries`), kept in ``tables.split_dates``.

    Raises DataError when an instrument breaks the price rule of
    :func:`foxhunt_jax.data.checks.first_price_problem` (the loader's rule, applied here to
    markets built in memory too) or a split has no valid episode start in any instrument.
    """
    _check_args(splits, episode_length)
    names = resolve_features(features, "features")
    for ins in market.instruments:
        problem = first_price_problem(ins.open, ins.high, ins.low, ins.close)
        if problem is not None:
            when = str(np.datetime64(ins.timestamps[problem.index], "s")).replace("T", " ")
            raise DataError(ins.source, f"instrument {ins.name}, bar {problem.index} ({when}): "
                                        f"{problem.message} ({PRICE_RULE})")
    L = int(episode_length)
    dates = split_boundaries(market, splits, split_dates)
    raw, sig, lr, prices, inst, stamps, train_local = [], [], [], [], [], [], []
    segments = {s: [] for s in SPLITS}
    starts = {s: [] for s in SPLITS}
    longest = dict.fromkeys(SPLITS, 0)  # bars of the longest instrument in each window
    offset = 0
    for i, ins in enumerate(market.instruments):
        keep = slice(WARMUP, None)
        rows = max(len(ins) - WARMUP, 0)
        with np.errstate(divide="ignore", invalid="ignore"):  # bad prices: reported below
            raw.append(instrument_features(ins, names)[keep])
            sig.append(rolling_sigma(np.asarray(ins.close, np.float64))[keep])
            lr.append(log_returns(np.asarray(ins.close, np.float64))[keep])
        prices.append(np.stack([np.asarray(a, np.float64)[keep]
                                for a in (ins.open, ins.high, ins.low, ins.close)]))
        inst.append(np.full(rows, i, np.int32))
        stamps.append(np.asarray(ins.timestamps)[keep].astype("datetime64[ns]"))
        for name, (a, b) in zip(SPLITS, split_bounds(stamps[-1], dates)):
            longest[name] = max(longest[name], b - a + 1)
        bounds = split_bounds(stamps[-1], dates, min_rows=L + 1)
        train_local.append(bounds[0])
        for name, (a, b) in zip(SPLITS, bounds):
            segments[name].append((offset + a, offset + b))
            if b - a >= L:  # needs L + 1 bars: s .. s + L
                starts[name].append(np.arange(offset + a, offset + b - L + 1, dtype=np.int32))
        offset += rows

    seg = {k: np.asarray(v, np.int64).reshape(-1, 2) for k, v in segments.items()}
    for name in SPLITS:
        if not starts[name]:
            sources = ", ".join(sorted({ins.source for ins in market.instruments})) or "market"
            raise DataError(sources, f"split '{name}' ({window_text(dates, name)}) has no valid "
                            f"episode start: it needs {L + 1} bars (episode_length + 1) of one "
                            f"instrument in that window after the {WARMUP}-bar warm-up, the "
                            f"longest has {longest[name]}")
    for ins, x in zip(market.instruments, raw):
        if not np.all(np.isfinite(x)):
            row, col = (int(v) for v in np.argwhere(~np.isfinite(x))[0])
            raise DataError(ins.source, f"feature '{names[col]}' is not finite at bar "
                            f"{row + WARMUP} of instrument {ins.name}")
    mean, std = _train_stats(raw, train_local)
    normed = np.empty((offset, len(names)), np.float32)
    row = 0
    for x in raw:  # per instrument, so no float64 copy of the whole table is made
        normed[row: row + len(x)] = normalize(x, mean, std)
        row += len(x)
    p = np.concatenate(prices, axis=1).astype(np.float32)
    return MarketTables(
        features=normed,
        open=p[0], high=p[1], low=p[2], close=p[3],
        sigma=np.concatenate(sig).astype(np.float32),
        last_log_return=np.concatenate(lr).astype(np.float32),
        instrument=np.concatenate(inst).astype(np.int32),
        timestamps=np.concatenate(stamps),
        segments=seg,
        starts={k: np.concatenate(v).astype(np.int32) for k, v in starts.items()},
        feature_names=names,
        norm_mean=mean,
        norm_std=std,
        instrument_names=tuple(ins.name for ins in market.instruments),
        bar_seconds=float(market.bar_seconds),
        bars_per_year=float(market.bars_per_year),
        episode_length=L,
        split_dates=dates,
    )


__all__ = ["MarketTables", "Feature", "LookAheadError", "build_tables", "normalize",
           "instrument_features", "builtin_columns", "register", "unregister", "registered",
           "feature", "resolve_features", "check_no_lookahead", "random_bars", "rolling_sigma",
           "log_returns", "split_bounds", "split_boundaries", "parse_split_dates", "SplitDates",
           "window_text",
           "tables_peak_bytes", "DEFAULT_FEATURES", "MAX_WINDOW", "WARMUP", "SPLITS"]
