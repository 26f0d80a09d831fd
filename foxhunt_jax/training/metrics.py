"""Trading metrics of equity paths, and the trade log of a walk, on the host in float64 NumPy.

These run once per epoch (validation) and once per evaluation on small arrays, so clarity wins
over speed: no JAX here. The same function scores the agent, buy-and-hold and the random policy,
so the three are always comparable.

Definitions (``W`` windows, ``T`` bars per window, ``E[w, t]`` equity, ``x[w, t]`` exposure):

* **valid bars**: bar ``t`` of window ``w`` is valid when ``E[w, 0..t+1]`` are all finite. A
  window ends at its first non-finite equity value (episodes that stop early are NaN-padded).
* **per-bar log return**: ``r[w, t] = log(E[w, t+1] / E[w, t])`` over valid bars. Equity at or
  below zero (a total loss) is floored at ``1e-12`` times the window's initial equity first, so
  a wipe-out counts as a very large loss instead of a NaN.
* All bar statistics below pool the valid bars of all windows into one sample of size ``n``;
  ``mean`` and ``std`` are over that sample (``std`` with ``ddof=0``). Risk-free rate is 0.
  ``bars_per_year`` (``A``) is the annualization factor (``MarketData.bars_per_year``).
* ``total_return``: mean over windows of ``E_final / E[w, 0] - 1`` (``E_final`` = last finite
  equity of the window).
* ``annualized_return``: ``exp(A * mean(r)) - 1`` (geometric growth rate per year; inf if it
  overflows float64).
* ``annualized_volatility``: ``std(r) * sqrt(A)``.
* ``sharpe``: ``mean(r) / std(r) * sqrt(A)``; 0 when ``std(r) <= 1e-12`` (a flat or constant-growth
  path has no measurable risk, and 0 is a safer report than inf or NaN).
* ``sortino``: ``mean(r) / dd * sqrt(A)`` with downside deviation ``dd = sqrt(mean(min(r, 0)^2))``;
  0 when ``dd <= 1e-12``.
* ``max_drawdown``: mean over windows of ``max_t (1 - E[w, t] / max_{s <= t} E[w, s])``, a
  positive fraction (0.5 = lost half from the peak); ``max_drawdown_worst`` is the largest of them.
* ``calmar``: ``annualized_return / max_drawdown``; 0 when ``max_drawdown <= 1e-12``.
* ``turnover``: ``mean |x[w, t] - x[w, t-1]|`` over valid bars with ``x[w, -1] = 0`` (episodes
  start flat; a NaN exposure on a valid bar counts as flat): average fraction of equity
  traded per bar.
* ``trades``: total count of trades (the sum of per-window counts, or of per-bar traded flags
  over valid bars).
* ``time_in_market``: fraction of valid bars with ``x[w, t] != 0``.
* ``hit_rate``: among valid bars with ``x[w, t] != 0``, the fraction with ``r[w, t] > 0``
  (how often holding a position paid over one bar); 0 when never in the market.
* ``bars``: ``n``, the number of valid bars pooled.

Every value is a Python ``float`` except ``trades`` and ``bars`` (``int``).
"""

from __future__ import annotations

import numpy as np

_TINY = 1e-12  # below this a std / drawdown counts as zero
_EQUITY_FLOOR = 1e-12  # fraction of initial equity used in place of a non-positive equity

METRIC_KEYS = (
    "total_return", "annualized_return", "annualized_volatility", "sharpe", "sortino",
    "max_drawdown", "max_drawdown_worst", "calmar", "turnover", "trades", "hit_rate",
    "time_in_market", "bars",
)


def valid_bars(equity: np.ndarray) -> np.ndarray:
    """Mask of valid bars: ``[W, T+1] -> bool [W, T]``, True while ``E[w, 0..t+1]`` are finite."""
    finite_prefix = np.cumprod(np.isfinite(equity), axis=1).astype(bool)
    return finite_prefix[:, 1:]


def log_returns(equity: np.ndarray) -> np.ndarray:
    """Per-bar log returns ``[W, T+1] -> [W, T]`` float64, 0 on invalid bars."""
    e = np.asarray(equity, np.float64)
    floor = _EQUITY_FLOOR * np.abs(e[:, :1])
    with np.errstate(invalid="ignore", divide="ignore"):
        safe = np.maximum(e, floor)
        r = np.log(safe[:, 1:] / safe[:, :-1])
    return np.where(valid_bars(e), r, 0.0)


def max_drawdowns(equity: np.ndarray) -> np.ndarray:
    """Max drawdown of each window as a positive fraction: ``[W, T+1] -> [W]`` float64."""
    e = np.asarray(equity, np.float64)
    alive = np.cumprod(np.isfinite(e), axis=1).astype(bool)
    peak = np.maximum.accumulate(np.where(alive, e, -np.inf), axis=1)  # running peak
    with np.errstate(invalid="ignore", divide="ignore"):
        dd = np.where(alive & (peak > 0), 1.0 - e / peak, 0.0)
    return np.max(dd, axis=1)


def _safe_ratio(num: float, den: float) -> float:
    return float(num / den) if den > _TINY else 0.0


def trading_metrics(equity, exposure, trades, bars_per_year: float) -> dict:
    """Trading metrics of ``W`` equity paths (definitions in the module docstring).

    Args:
      equity: ``[W, T+1]`` (or ``[T+1]`` for one window) equity paths starting at the initial
        equity; may be NaN-padded after a window ends.
      exposure: ``[W, T]`` (or ``[T]``) position held over each bar (signed fraction of equity).
      trades: ``[W]`` trade counts per window, or ``[W, T]`` per-bar traded flags.
      bars_per_year: annualization factor, > 0.

    Returns:
      dict with the keys of :data:`METRIC_KEYS`.
    """
    e = np.asarray(equity, np.float64)
    x = np.asarray(exposure, np.float64)
    tr = np.asarray(trades, np.float64)
    if e.ndim == 1:  # one window: add the window axis everywhere
        e, x, tr = e[None], x[None], tr[None]
    if e.ndim != 2 or x.ndim != 2:
        raise ValueError(f"equity and exposure must be [W, T+1] and [W, T], got {e.shape}, "
                         f"{x.shape}")
    n_windows, t_plus_1 = e.shape
    if t_plus_1 < 2:
        raise ValueError(f"equity needs at least 2 points per window, got shape {e.shape}")
    if x.shape != (n_windows, t_plus_1 - 1):
        raise ValueError(f"exposure shape {x.shape} does not match equity shape {e.shape}")
    if tr.shape not in ((n_windows,), x.shape):
        raise ValueError(f"trades shape {tr.shape} must be ({n_windows},) or {x.shape}")
    if not bars_per_year > 0:
        raise ValueError(f"bars_per_year must be > 0, got {bars_per_year}")
    if not np.all(np.isfinite(e[:, 0]) & (e[:, 0] > 0)):
        raise ValueError("every window needs a finite, positive initial equity")

    valid = valid_bars(e)
    n = int(valid.sum())
    r_all = log_returns(e)
    r = r_all[valid]
    x = np.where(valid, np.nan_to_num(x, nan=0.0), 0.0)

    lengths = valid.sum(axis=1)
    final = e[np.arange(n_windows), lengths]
    total_return = float(np.mean(final / e[:, 0] - 1.0))

    mean = float(np.mean(r)) if n else 0.0
    std = float(np.std(r)) if n else 0.0
    down = float(np.sqrt(np.mean(np.minimum(r, 0.0) ** 2))) if n else 0.0
    sqrt_a = float(np.sqrt(bars_per_year))
    with np.errstate(over="ignore"):  # inf is the honest answer when growth overflows float64
        annualized_return = float(np.expm1(bars_per_year * mean))

    dd = max_drawdowns(e)
    max_dd = float(np.mean(dd))

    prev = np.concatenate([np.zeros((n_windows, 1)), x[:, :-1]], axis=1)
    turnover = float(np.abs(x - prev)[valid].sum() / n) if n else 0.0
    in_market = (x != 0) & valid
    n_in = int(in_market.sum())
    wins = int(((r_all > 0) & in_market).sum())

    if tr.ndim == 2:
        n_trades = int(np.round(np.nan_to_num(tr)[valid].sum()))
    else:
        n_trades = int(np.round(np.nan_to_num(tr).sum()))

    return {
        "total_return": total_return,
        "annualized_return": annualized_return,
        "annualized_volatility": std * sqrt_a,
        "sharpe": _safe_ratio(mean, std) * sqrt_a,
        "sortino": _safe_ratio(mean, down) * sqrt_a,
        "max_drawdown": max_dd,
        "max_drawdown_worst": float(np.max(dd)),
        "calmar": _safe_ratio(annualized_return, max_dd),
        "turnover": turnover,
        "trades": n_trades,
        "hit_rate": wins / n_in if n_in else 0.0,
        "time_in_market": n_in / n if n else 0.0,
        "bars": n,
    }


# info["barrier"] codes of the env (foxhunt_jax.env.trading: NONE, TAKE_PROFIT, STOP_LOSS, TIME)
_EXIT_REASONS = {1: "take_profit", 2: "stop_loss", 3: "time"}
TRADE_COLUMNS = ("instrument", "entry_time", "exit_time", "entry_price", "exit_price", "side",
                 "size", "exit_reason", "cost", "pnl")


def trade_log(steps: dict, close: np.ndarray, timestamps: np.ndarray,
              instruments: list[str]) -> list[dict]:
    """The trades of walks without reset, one row per position held (``TRADE_COLUMNS``).

    Args:
      steps: ``[W, L]`` host arrays of each walk's steps (one walk per instrument, equity 1 at
        its start): ``bar`` (global bar of the decision), ``target`` (the exposure chosen),
        ``traded``, ``cost`` (the step's trade and barrier-exit costs), ``barrier`` (the env's
        exit code on the next bar), ``exit_price``, ``equity`` (marked at the next close),
        ``terminated`` (ruin), ``alive``.
      close, timestamps: ``[T]`` of the market tables the bars index.
      instruments: the instrument name of each walk.

    A trade opens when the exposure moves to a non-zero value (a move between two non-zero
    values closes one trade and opens another, as the env re-enters at the close) and ends by
    ``signal`` (the agent moves the exposure), ``take_profit``, ``stop_loss``, ``time``, ``ruin``
    or ``end`` (still open at the walk's last bar, marked at its close). A fill's cost belongs
    to the trade it opens, or to the trade it closes when it goes flat; a barrier exit's cost
    to the trade it ends. ``pnl`` is the walk's equity change over the trade (costs included,
    in units of the walk's initial equity): the equity from the close before its entry fill
    to its exit, so the pnl of a walk's trades sums to its equity change (equity is constant
    while flat).
    """
    rows: list[dict] = []
    for w, name in enumerate(instruments):
        trade: dict | None = None
        before = 1.0  # equity at the close of the decision bar, before its fill
        alive = np.asarray(steps["alive"][w], bool)

        def close_trade(at: int, price: float, reason: str, equity: float) -> None:
            trade.update(exit_time=timestamps[at], exit_price=float(price), exit_reason=reason,
                         pnl=float(equity) - trade.pop("base"))
            rows.append(trade)

        last = -1
        for k in np.flatnonzero(alive):
            last = k
            bar, target = int(steps["bar"][w, k]), float(steps["target"][w, k])
            cost, after = float(steps["cost"][w, k]), float(steps["equity"][w, k])
            if steps["traded"][w, k]:
                if trade is not None:
                    flat = target == 0
                    trade["cost"] += cost if flat else 0.0
                    close_trade(bar, close[bar], "signal", after if flat else before)
                    trade = None
                if target != 0:
                    trade = {"instrument": name, "entry_time": timestamps[bar],
                             "exit_time": None, "entry_price": float(close[bar]),
                             "exit_price": None, "side": "long" if target > 0 else "short",
                             "size": abs(target), "exit_reason": None, "cost": cost,
                             "pnl": None, "base": before}
            elif trade is not None:
                trade["cost"] += cost  # a barrier exit's cost (0 on other bars)
            reason = _EXIT_REASONS.get(int(steps["barrier"][w, k]))
            if trade is not None and reason is not None:
                close_trade(bar + 1, steps["exit_price"][w, k], reason, after)
                trade = None
            elif trade is not None and steps["terminated"][w, k]:
                close_trade(bar + 1, close[bar + 1], "ruin", after)
                trade = None
            before = after
        if trade is not None:
            end = int(steps["bar"][w, last]) + 1
            close_trade(end, close[end], "end", before)
    return rows


__all__ = ["trading_metrics", "log_returns", "max_drawdowns", "valid_bars", "trade_log",
           "METRIC_KEYS", "TRADE_COLUMNS"]
