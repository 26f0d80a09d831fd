"""A seeded synthetic market with a planted signal of known strength.

Each instrument's one-bar log returns ``r`` (close to close) follow a stationary Gaussian AR(1):

    r[0] = vol * eps[0],        r[t+1] = rho * r[t] + sqrt(1 - rho^2) * vol * eps[t+1],

with ``eps`` i.i.d. standard normal, ``rho = cfg.signal_strength`` and ``vol = cfg.volatility``.
Every ``r[t]`` then has mean 0 and standard deviation ``vol``, and the known, learnable signal is:

- the lag-1 autocorrelation of log returns is ``rho``;
- given the last return, ``E[r[t+1] | r[t]] = rho * r[t]`` (residual std ``vol*sqrt(1-rho^2)``);
- the oracle policy ``sign(r[t])`` (:func:`oracle_exposure`), held for one bar, earns a mean
  per-bar log return ``E[sign(r[t]) r[t+1]] = rho * E|r[t]| = rho * vol * sqrt(2 / pi)``.

``r[0]`` is the return into bar 0 from an unobserved previous close, so the first observable
return (bar 1) is already stationary. Bars (per instrument, shapes [bars]):

- ``Close[t] = C0 * exp(r[1] + ... + r[t])`` with a random start ``C0`` around 100;
- ``Open[t] = Close[t-1] * exp(0.05 * vol * n)`` (no gap beyond a tiny noise ``n``);
- ``High = max(Open, Close) * exp(|0.5 * vol * n'|)``, ``Low = min(Open, Close) * exp(-|...|)``,
  so every bar passes the loader's validation;
- ``Volume`` lognormal around 1e6.

Timestamps: business days from 2000-01-03. A series too long for daily stamps before the end of
the datetime64[ns] range (about 68,000 bars) uses consecutive hours, then minutes, then seconds.
"""

from __future__ import annotations

import sys

import numpy as np
from foxhunt_jax.config import SyntheticConfig
from foxhunt_jax.data.market import (
    Instrument,
    MarketData,
    median_bar_seconds,
    observed_bars_per_year,
)

SYNTHETIC_SOURCE = "builtin:synthetic"
START_DAY = np.datetime64("2000-01-03", "D")  # a Monday
_LAST_NS_DAY = np.datetime64("2262-04-10", "D")  # datetime64[ns] ends on 2262-04-11


def ar1_log_returns(eps: np.ndarray, rho: float, vol: float) -> np.ndarray:
    """Stationary AR(1) log returns from standard normal shocks.

    Args:
      eps: [..., n] float64 standard normal shocks.
      rho: lag-1 autocorrelation, in [0, 1).
      vol: standard deviation of each return.
    Returns:
      r: [..., n] float64 with r[0] = vol * eps[0], r[t] = rho r[t-1] + sqrt(1-rho^2) vol eps[t].
    """
    eps = np.asarray(eps, dtype=np.float64)
    x = np.sqrt(1.0 - rho * rho) * vol * eps
    x[..., 0] = vol * eps[..., 0]
    return _ar1_filter(x, rho)


def _ar1_filter(x: np.ndarray, rho: float, block: int = 256) -> np.ndarray:
    """y[t] = x[t] + rho * y[t-1] (y[-1] = 0) along the last axis, in blocks: inside a block
    y = x @ M.T + rho^(i+1) * y_prev with M[i, j] = rho^(i-j) (i >= j), so the Python loop runs
    n / block times instead of n."""
    n = x.shape[-1]
    lag = np.arange(block)[:, None] - np.arange(block)[None, :]
    mix = np.where(lag >= 0, rho ** np.maximum(lag, 0), 0.0)  # [block, block]
    carry_w = rho ** np.arange(1, block + 1)  # [block]
    y = np.empty_like(x)
    prev = np.zeros(x.shape[:-1] + (1,))
    for s in range(0, n, block):
        e = min(s + block, n)
        m = e - s
        y[..., s:e] = x[..., s:e] @ mix[:m, :m].T + prev * carry_w[:m]
        prev = y[..., e - 1:e]
    return y


def synthetic_timestamps(bars: int) -> np.ndarray:
    """[bars] datetime64[ns]: business days from 2000-01-03, or finer steps when those would
    run past 2262 (hours, then minutes, then seconds from 2000-01-03 00:00)."""
    if bars <= np.busday_count(START_DAY, _LAST_NS_DAY):
        days = np.busday_offset(START_DAY, np.arange(bars), roll="forward")
        return days.astype("datetime64[ns]")
    start = START_DAY.astype("datetime64[s]")
    room_s = (_LAST_NS_DAY.astype("datetime64[s]") - start) / np.timedelta64(1, "s")
    for unit, seconds in (("h", 3600), ("m", 60), ("s", 1)):
        if bars * seconds <= room_s:
            return (start + np.arange(bars) * np.timedelta64(seconds, "s")).astype("datetime64[ns]")
    raise ValueError(f"{bars} bars do not fit in the datetime64[ns] range")


# float64 [instruments, bars] arrays alive at once in make_synthetic (shocks, returns, log
# closes, closes, previous closes, opens, highs, lows, volumes, a temporary) plus the
# per-instrument copies of the six Instrument columns; [bars] arrays for the timestamps and
# their temporaries.
_GENERATION_ARRAYS = 10 + 6
_TIMESTAMP_ARRAYS = 16


def synthetic_peak_bytes(cfg: SyntheticConfig) -> int:
    """Upper bound of the host bytes :func:`make_synthetic` holds at its peak (Python ints, so
    that absurd sizes are measured, not overflowed)."""
    bars = int(cfg.instruments) * int(cfg.bars)
    return 8 * (_GENERATION_ARRAYS * bars + _TIMESTAMP_ARRAYS * int(cfg.bars))


def make_synthetic(cfg: SyntheticConfig) -> MarketData:
    """``cfg.instruments`` instruments of ``cfg.bars`` bars with the planted AR(1) signal.

    Deterministic in ``cfg.seed`` (one ``numpy.random.Generator``). Instruments are named
    ``SYN0, SYN1, ...`` (zero-padded when there are more than ten).
    """
    rng = np.random.default_rng(cfg.seed)
    k, n, vol = cfg.instruments, cfg.bars, cfg.volatility
    r = ar1_log_returns(rng.standard_normal((k, n)), cfg.signal_strength, vol)  # [k, n]
    log_c0 = np.log(100.0) + rng.uniform(-1.0, 1.0, size=(k, 1))
    log_close = log_c0 + np.cumsum(r, axis=1) - r[:, :1]  # Close[0] = C0
    close = np.exp(log_close)
    prev_close = np.exp(log_close - r)
    open_ = prev_close * np.exp(0.05 * vol * rng.standard_normal((k, n)))
    high = np.maximum(open_, close) * np.exp(np.abs(0.5 * vol * rng.standard_normal((k, n))))
    low = np.minimum(open_, close) * np.exp(-np.abs(0.5 * vol * rng.standard_normal((k, n))))
    volume = np.exp(rng.normal(np.log(1e6), 0.5, size=(k, n)))
    ts = synthetic_timestamps(n)
    width = len(str(k - 1))
    instruments = tuple(
        Instrument(
            name=f"SYN{i:0{width}d}", source=SYNTHETIC_SOURCE, timestamps=ts.copy(),
            open=open_[i].copy(), high=high[i].copy(), low=low[i].copy(), close=close[i].copy(),
            volume=volume[i].copy(),
        )
        for i in range(k)
    )
    return MarketData(instruments=instruments, bar_seconds=median_bar_seconds(instruments),
                      bars_per_year=observed_bars_per_year(instruments))


def oracle_exposure(last_log_return):
    """The policy that exploits the planted signal: +1 where the last return > 0, -1 where < 0,
    0 where it is 0.

    Args:
      last_log_return: [...] NumPy or JAX array (works under ``jax.jit``).
    Returns:
      [...] same shape, dtype and array kind.
    """
    jax = sys.modules.get("jax")  # a jax.Array implies jax is already imported
    if jax is not None and isinstance(last_log_return, jax.Array):
        return jax.numpy.sign(last_log_return)
    return np.sign(np.asarray(last_log_return))


__all__ = ["make_synthetic", "oracle_exposure", "ar1_log_returns", "synthetic_timestamps",
           "SYNTHETIC_SOURCE"]
