"""Trading metrics of equity paths, and the trade log of a walk, on the host in float64 NumPy.

These run once per epoch (validation) and once per evaluation on small arrays, so clarity wins
over speed: no JAX here. The same function scores the agent, buy-and-hold and the random policy,
so the three are always comparable. The last section builds what a full-split evaluation
reports: each policy's walks as one equal-weight portfolio by date, the random policies'
percentiles and the agent's rank among them (:func:`evaluation_results`).

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
* ``turnover``: average fraction of equity traded per bar: the mean over valid bars of the
  per-bar ``turnover`` given (the env's: every fill counted, the chosen trades and the barrier
  and ruin exits); without it, of ``|x[w, t] - x[w, t-1]|`` with ``x[w, -1] = 0`` (episodes
  start flat; a NaN exposure on a valid bar counts as flat), which is exact only when every
  position change is a chosen trade (buy-and-hold).
* ``trades``: total count of trades (the sum of per-window counts, or of per-bar counts over
  valid bars; pass the env's per-bar fills so that exits count).
* ``time_in_market``: fraction of valid bars with ``x[w, t] != 0``.
* ``hit_rate``: among valid bars with ``x[w, t] != 0``, the fraction with ``r[w, t] > 0``
  (how often holding a position paid over one bar); 0 when never in the market.
* ``bars``: ``n``, the number of valid bars pooled.

Every value is a Python ``float`` except ``trades`` and ``bars`` (``int``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

ZERO_RISK = 1e-12  # below this a std / drawdown counts as zero (the Sharpe ratio is then 0)
# Runs whose metrics one pass of array operations computes: more at once outgrow the CPU's
# caches and run slower (docs/performance.md, "The host's records off the device's path").
RUNS_AT_ONCE = 8
_EQUITY_FLOOR = 1e-12  # fraction of initial equity used in place of a non-positive equity

METRIC_KEYS = (
    "total_return", "annualized_return", "annualized_volatility", "sharpe", "sortino",
    "max_drawdown", "max_drawdown_worst", "calmar", "turnover", "trades", "hit_rate",
    "time_in_market", "bars",
)


def valid_bars(equity: np.ndarray) -> np.ndarray:
    """Mask of valid bars: ``[..., W, T+1] -> bool [..., W, T]``, True while ``E[w, 0..t+1]``
    are finite."""
    finite_prefix = np.cumprod(np.isfinite(equity), axis=-1).astype(bool)
    return finite_prefix[..., 1:]


def log_returns(equity: np.ndarray) -> np.ndarray:
    """Per-bar log returns ``[..., W, T+1] -> [..., W, T]`` float64, 0 on invalid bars."""
    e = np.asarray(equity, np.float64)
    floor = _EQUITY_FLOOR * np.abs(e[..., :1])
    with np.errstate(invalid="ignore", divide="ignore"):
        safe = np.maximum(e, floor)
        r = np.log(safe[..., 1:] / safe[..., :-1])
    return np.where(valid_bars(e), r, 0.0)


def max_drawdowns(equity: np.ndarray) -> np.ndarray:
    """Max drawdown of each window as a positive fraction: ``[..., W, T+1] -> [..., W]``
    float64."""
    e = np.asarray(equity, np.float64)
    alive = np.cumprod(np.isfinite(e), axis=-1).astype(bool)
    peak = np.maximum.accumulate(np.where(alive, e, -np.inf), axis=-1)  # running peak
    with np.errstate(invalid="ignore", divide="ignore"):
        dd = np.where(alive & (peak > 0), 1.0 - e / peak, 0.0)
    return np.max(dd, axis=-1)


def _safe_ratio(num: float, den: float) -> float:
    return float(num / den) if den > ZERO_RISK else 0.0


def trading_metrics(equity, exposure, trades, bars_per_year: float, turnover=None) -> dict:
    """Trading metrics of ``W`` equity paths (definitions in the module docstring).

    Args:
      equity: ``[W, T+1]`` (or ``[T+1]`` for one window) equity paths starting at the initial
        equity; may be NaN-padded after a window ends.
      exposure: ``[W, T]`` (or ``[T]``) position held over each bar (signed fraction of equity).
      trades: ``[W]`` trade counts per window, or ``[W, T]`` per-bar trade counts.
      bars_per_year: annualization factor, > 0.
      turnover: ``[W, T]`` (or ``[T]``) fraction of equity traded on each bar, or None to take
        it from the changes of ``exposure``.

    Returns:
      dict with the keys of :data:`METRIC_KEYS`.
    """
    e = np.asarray(equity, np.float64)
    x = np.asarray(exposure, np.float64)
    tr = np.asarray(trades, np.float64)
    per_bar = None if turnover is None else np.asarray(turnover, np.float64)
    if e.ndim == 1:  # one window: add the window axis everywhere
        e, x, tr = e[None], x[None], tr[None]
        per_bar = None if per_bar is None else per_bar[None]
    if e.ndim != 2 or x.ndim != 2:
        raise ValueError(f"equity and exposure must be [W, T+1] and [W, T], got {e.shape}, "
                         f"{x.shape}")
    return trading_metrics_of_runs(e[None], x[None], tr[None], bars_per_year,
                                   None if per_bar is None else per_bar[None])[0]


def trading_metrics_of_runs(equity, exposure, trades, bars_per_year: float,
                            turnover=None) -> list[dict]:
    """:func:`trading_metrics` of ``R`` runs at once (a population's members, random policies):
    ``equity [R, W, T+1]``, ``exposure [R, W, T]``, ``trades [R, W]`` or ``[R, W, T]`` and
    ``turnover [R, W, T]`` or None, as :func:`trading_metrics` takes them for one run. Returns
    one dict a run, equal to that run's :func:`trading_metrics` up to float rounding (each
    statistic is one array operation over all runs instead of ``R`` calls)."""
    e = np.asarray(equity, np.float64)
    x = np.asarray(exposure, np.float64)
    tr = np.asarray(trades, np.float64)
    per_bar = None if turnover is None else np.asarray(turnover, np.float64)
    if e.ndim != 3 or x.ndim != 3:
        raise ValueError(f"equity and exposure must be [R, W, T+1] and [R, W, T], got "
                         f"{e.shape}, {x.shape}")
    runs, n_windows, t_plus_1 = e.shape
    if t_plus_1 < 2:
        raise ValueError(f"equity needs at least 2 points per window, got shape {e.shape[1:]}")
    if x.shape != (runs, n_windows, t_plus_1 - 1):
        raise ValueError(f"exposure shape {x.shape[1:]} does not match equity shape "
                         f"{e.shape[1:]}")
    if per_bar is not None and per_bar.shape != x.shape:
        raise ValueError(f"turnover shape {per_bar.shape[1:]} does not match exposure "
                         f"{x.shape[1:]}")
    if tr.shape not in ((runs, n_windows), x.shape):
        raise ValueError(f"trades shape {tr.shape[1:]} must be ({n_windows},) or {x.shape[1:]}")
    if not bars_per_year > 0:
        raise ValueError(f"bars_per_year must be > 0, got {bars_per_year}")
    if not np.all(np.isfinite(e[..., 0]) & (e[..., 0] > 0)):
        raise ValueError("every window needs a finite, positive initial equity")
    if runs > RUNS_AT_ONCE:
        return [m for i in range(0, runs, RUNS_AT_ONCE) for m in _metrics_of_runs(
            e[i:i + RUNS_AT_ONCE], x[i:i + RUNS_AT_ONCE], tr[i:i + RUNS_AT_ONCE],
            bars_per_year, None if per_bar is None else per_bar[i:i + RUNS_AT_ONCE])]
    return _metrics_of_runs(e, x, tr, bars_per_year, per_bar)


def _metrics_of_runs(e, x, tr, bars_per_year, per_bar) -> list[dict]:
    """:func:`trading_metrics_of_runs` of checked float64 arrays."""
    runs, n_windows = e.shape[:2]
    valid = valid_bars(e)  # [R, W, T]
    n = valid.sum(axis=(1, 2))  # [R]
    some = n > 0
    per_bar_count = np.maximum(n, 1)
    r = log_returns(e)  # 0 on invalid bars, so sums over all bars are sums over the valid ones
    x = np.where(valid, np.nan_to_num(x, nan=0.0), 0.0)

    lengths = valid.sum(axis=2)  # [R, W]
    final = np.take_along_axis(e, lengths[..., None], axis=2)[..., 0]
    total_return = np.mean(final / e[..., 0] - 1.0, axis=1)

    mean = np.where(some, r.sum(axis=(1, 2)) / per_bar_count, 0.0)
    centred = np.where(valid, r - mean[:, None, None], 0.0)
    std = np.where(some, np.sqrt((centred ** 2).sum(axis=(1, 2)) / per_bar_count), 0.0)
    down = np.where(some, np.sqrt((np.minimum(r, 0.0) ** 2).sum(axis=(1, 2)) / per_bar_count),
                    0.0)
    sqrt_a = float(np.sqrt(bars_per_year))
    with np.errstate(over="ignore"):  # inf is the honest answer when growth overflows float64
        annualized_return = np.expm1(bars_per_year * mean)

    dd = max_drawdowns(e)  # [R, W]

    if per_bar is None:
        prev = np.concatenate([np.zeros((runs, n_windows, 1)), x[..., :-1]], axis=2)
        per_bar = np.abs(x - prev)
    turnover_sum = np.where(valid, np.nan_to_num(per_bar), 0.0).sum(axis=(1, 2))
    in_market = (x != 0) & valid
    n_in = in_market.sum(axis=(1, 2))
    wins = ((r > 0) & in_market).sum(axis=(1, 2))
    if tr.ndim == 3:
        n_trades = np.round(np.where(valid, np.nan_to_num(tr), 0.0).sum(axis=(1, 2)))
    else:
        n_trades = np.round(np.nan_to_num(tr).sum(axis=1))

    out = []
    for i in range(runs):
        bars, held, max_dd = int(n[i]), int(n_in[i]), float(np.mean(dd[i]))
        growth = float(annualized_return[i])
        out.append({
            "total_return": float(total_return[i]),
            "annualized_return": growth,
            "annualized_volatility": float(std[i]) * sqrt_a,
            "sharpe": _safe_ratio(mean[i], std[i]) * sqrt_a,
            "sortino": _safe_ratio(mean[i], down[i]) * sqrt_a,
            "max_drawdown": max_dd,
            "max_drawdown_worst": float(np.max(dd[i])),
            "calmar": _safe_ratio(growth, max_dd),
            "turnover": float(turnover_sum[i] / bars) if bars else 0.0,
            "trades": int(n_trades[i]),
            "hit_rate": int(wins[i]) / held if held else 0.0,
            "time_in_market": held / bars if bars else 0.0,
            "bars": bars,
        })
    return out


# ---------------------------------------------------------------------------------------------
# The equal-weight portfolio by date, and the random policies' distribution


def portfolio_by_date(equity, exposure, traded, bar_dates: Sequence[np.ndarray]) -> dict:
    """The equal-weight portfolio of ``W`` instrument walks, by date.

    Args:
      equity: ``[..., W, L+1]`` equity of each walk (starting at 1), NaN after it ends; any
        leading axes (e.g. random policies) are separate portfolios.
      exposure: ``[..., W, L]`` position held over each bar.
      traded: ``[..., W, L]`` per-bar traded flags (or trade counts).
      bar_dates: ``W`` arrays ``[n_w + 1]`` (``n_w <= L``) of datetime64: the date of each equity
        mark of walk ``w`` (``bar_dates[w][j]`` is when ``equity[..., w, j]`` is marked).

    The dates are the first walk's start and every date a walk's bar ends on (sorted, once
    each). On each date the portfolio's simple return is the mean over the instruments trading
    on it (those whose walk has a valid bar ending there, :func:`valid_bars`) of their simple
    returns over that bar, i.e. equal weights rebalanced every date; on a date none trades (every
    walk ended early) it is 0. Its exposure on a date is the same mean of the instruments'
    exposures (the portfolio's net exposure) and its trades the sum of theirs. A non-positive
    equity is floored as in :func:`log_returns` first.

    Returns:
      dict: ``dates [K+1]`` datetime64; ``equity [..., K+1]`` (1 at ``dates[0]``), ``exposure``,
      ``trades`` and ``instruments`` (how many traded) ``[..., K]``, float64.
    """
    e = np.asarray(equity, np.float64)
    x = np.asarray(exposure, np.float64)
    tr = np.asarray(traded, np.float64)
    if e.ndim < 2 or e.shape[-2] != len(bar_dates) or x.shape != e.shape[:-1] + (e.shape[-1] - 1,):
        raise ValueError(f"equity {e.shape} and exposure {x.shape} must be [..., W, L+1] and "
                         f"[..., W, L] with W = {len(bar_dates)} date arrays")
    dates = np.unique(np.concatenate([[min(d[0] for d in bar_dates)]]
                                     + [np.asarray(d[1:]) for d in bar_dates]))
    lead, k = e.shape[:-2], len(dates) - 1
    sums = {name: np.zeros(lead + (k,)) for name in ("return", "exposure", "trades", "count")}
    for w, d in enumerate(bar_dates):
        n = len(d) - 1
        if n > e.shape[-1] - 1:
            raise ValueError(f"walk {w} has {n + 1} dates for {e.shape[-1]} equity marks")
        col = np.searchsorted(dates, d[1:]) - 1  # the portfolio bar each of its bars ends on
        ew = e[..., w, :n + 1]
        valid = valid_bars(ew.reshape(-1, n + 1)).reshape(ew.shape[:-1] + (n,))
        safe = np.maximum(np.nan_to_num(ew, nan=1.0), _EQUITY_FLOOR * ew[..., :1])
        r = safe[..., 1:] / safe[..., :-1] - 1.0
        for name, v in (("return", r), ("exposure", np.nan_to_num(x[..., w, :n])),
                        ("trades", np.nan_to_num(tr[..., w, :n])), ("count", 1.0)):
            sums[name][..., col] += np.where(valid, v, 0.0)  # a walk's columns are distinct
    count = sums["count"]
    mean = lambda v: np.divide(v, count, out=np.zeros_like(v), where=count > 0)  # noqa: E731
    growth = np.cumprod(1.0 + mean(sums["return"]), axis=-1)
    return {"dates": dates,
            "equity": np.concatenate([np.ones(lead + (1,)), growth], axis=-1),
            "exposure": mean(sums["exposure"]), "trades": sums["trades"], "instruments": count}


# Metrics of trading activity: a portfolio reports them pooled over its instruments' bars.
ACTIVITY_KEYS = ("turnover", "trades", "hit_rate", "time_in_market")


def portfolio_metrics(portfolio: dict, paths: dict, bars_per_year: float) -> dict | list:
    """The metrics of a :func:`portfolio_by_date` portfolio: :func:`trading_metrics` of its
    curve (one window over its dates), except :data:`ACTIVITY_KEYS`, which are
    :func:`trading_metrics` of the instruments' walks ``paths`` (``equity [..., W, L+1]``,
    ``exposure``, ``trades``, ``turnover``) pooled: per-instrument turnover, all fills (the
    chosen trades and the barrier and ruin exits), the share of instrument bars in the market and
    the share of those that paid. With leading axes, a list over them flattened."""
    e, x, tr = portfolio["equity"], portfolio["exposure"], portfolio["trades"]
    k, (w, n) = e.shape[-1], paths["equity"].shape[-2:]
    flat = lambda a, shape: np.reshape(a, (-1,) + shape)  # noqa: E731
    # every portfolio's curve and pooled walks at once (a random policy band has hundreds)
    curves = trading_metrics_of_runs(flat(e, (1, k)), flat(x, (1, k - 1)), flat(tr, (1, k - 1)),
                                     bars_per_year)
    pooled = trading_metrics_of_runs(
        flat(paths["equity"], (w, n)), flat(paths["exposure"], (w, n - 1)),
        flat(paths["trades"], (w, n - 1)), bars_per_year,
        turnover=flat(paths["turnover"], (w, n - 1)))
    out = [{key: walks[key] if key in ACTIVITY_KEYS else value for key, value in curve.items()}
           for curve, walks in zip(curves, pooled)]
    return out[0] if e.ndim == 1 else out


PERCENTILES = (5, 50, 95)
# The metrics where one policy beats another: a higher value, or for these a lower one.
HIGHER_IS_BETTER = ("total_return", "annualized_return", "sharpe", "sortino", "calmar",
                    "hit_rate")
LOWER_IS_BETTER = ("annualized_volatility", "max_drawdown", "max_drawdown_worst")


def metric_percentiles(samples: Sequence[dict], q: Sequence[int] = PERCENTILES) -> dict:
    """``{"p5": {metric: value}, "p50": ..., "p95": ...}`` over metric dicts (``np.percentile``,
    linear interpolation, NaN values left out)."""
    out = {f"p{p}": {} for p in q}
    for key in samples[0]:
        values = np.asarray([s[key] for s in samples], np.float64)
        finite = values[~np.isnan(values)]
        for p in q:
            out[f"p{p}"][key] = float(np.percentile(finite, p)) if finite.size else float("nan")
    return out


def beat_percentile(value: float, samples: Sequence[dict], key: str) -> float:
    """Percent (0..100) of ``samples`` whose ``key`` ``value`` beats (:data:`HIGHER_IS_BETTER`
    or :data:`LOWER_IS_BETTER`), a tie counting half."""
    others = np.asarray([s[key] for s in samples], np.float64)
    better = others < value if key in HIGHER_IS_BETTER else others > value
    return float(100.0 * (np.sum(better) + 0.5 * np.sum(others == value)) / len(others))


def beat_percentiles(metrics: dict, samples: Sequence[dict]) -> dict:
    """:func:`beat_percentile` of every metric of ``metrics`` that has a better side."""
    return {k: beat_percentile(metrics[k], samples, k) for k in metrics
            if k in HIGHER_IS_BETTER or k in LOWER_IS_BETTER}


def evaluation_results(paths: dict, random_paths: dict, bar_dates: Sequence[np.ndarray],
                       instruments: Sequence[str], bars_per_year: float) -> dict:
    """Everything a full-split evaluation reports, from the walks of every policy.

    Args:
      paths: policy name -> per-instrument paths (``equity [W, L+1]``, ``exposure``,
        ``trades`` (fills a bar) and ``turnover`` ``[W, L]``) of the deterministic policies;
        ``agent`` among them (``flat`` gets no per-instrument metrics).
      random_paths: the same with a leading axis ``[P, ...]``: ``P`` random policies.
      bar_dates, instruments: each walk's mark dates (:func:`portfolio_by_date`) and name.
      bars_per_year: annualization factor.

    Returns:
      ``dates [K+1]``: the portfolio's dates; ``curves``: name -> portfolio equity ``[K+1]``,
      with ``random_p5``, ``random_p50``, ``random_p95`` the random portfolios' percentiles
      date by date; ``exposure``: ``{"agent": [K]}``, the agent portfolio's net exposure;
      ``paths``: ``paths``; ``metrics`` (JSON-able): each policy's portfolio metrics by name;
      ``random``: ``policies`` (``P``) and ``p5``, ``p50``, ``p95``, each metric's percentile
      over the ``P`` random portfolios (:func:`metric_percentiles`); ``agent_percentile``:
      :func:`beat_percentiles` of the agent's portfolio among them; ``per_instrument``: policy
      -> instrument -> the metrics of that instrument's own walk; ``random_curves``
      ``[P, K+1]``: each random portfolio's equity (what a walk-forward chains across folds).
    """
    portfolios = {name: portfolio_by_date(p["equity"], p["exposure"], p["trades"], bar_dates)
                  for name, p in paths.items()}
    rand = portfolio_by_date(random_paths["equity"], random_paths["exposure"],
                             random_paths["trades"], bar_dates)
    metrics = {name: portfolio_metrics(portfolios[name], p, bars_per_year)
               for name, p in paths.items()}
    samples = portfolio_metrics(rand, random_paths, bars_per_year)
    metrics["random"] = {"policies": len(samples), **metric_percentiles(samples)}
    metrics["agent_percentile"] = beat_percentiles(metrics["agent"], samples)
    names = [n if list(instruments).count(n) == 1 else f"{n}#{w}"
             for w, n in enumerate(instruments)]  # a repeated name gets its walk's index
    metrics["per_instrument"] = {
        name: {ins: trading_metrics(p["equity"][w], p["exposure"][w], p["trades"][w],
                                    bars_per_year, turnover=p["turnover"][w])
               for w, ins in enumerate(names)}
        for name, p in paths.items() if name != "flat"}
    curves = {name: p["equity"] for name, p in portfolios.items()}
    for q in PERCENTILES:
        curves[f"random_p{q}"] = np.percentile(rand["equity"], q, axis=0)
    return {"dates": rand["dates"], "curves": curves,
            "exposure": {"agent": portfolios["agent"]["exposure"]}, "metrics": metrics,
            "paths": paths, "random_curves": rand["equity"]}



# info["barrier"] codes of the env (foxhunt_jax.env.trading: TAKE_PROFIT, STOP_LOSS, TIME, RUIN)
_EXIT_REASONS = {1: "take_profit", 2: "stop_loss", 3: "time", 4: "ruin"}
TRADE_COLUMNS = ("instrument", "entry_time", "exit_time", "entry_price", "exit_price", "side",
                 "size", "exit_reason", "cost", "pnl")


def trade_log(steps: dict, close: np.ndarray, timestamps: np.ndarray,
              instruments: list[str]) -> list[dict]:
    """The trades of walks without reset, one row per position held (``TRADE_COLUMNS``).

    Args:
      steps: ``[W, L]`` host arrays of each walk's steps (one walk per instrument, equity 1 at
        its start): ``bar`` (global bar of the decision), ``fill_bar`` (the bar its trade fills
        on, ``env.fill``), ``fill_price`` (the trade's executed price), ``target`` (the exposure
        chosen), ``traded``, ``cost`` (the step's trade and barrier-exit costs), ``barrier`` (the env's
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
            fill_bar, fill_price = int(steps["fill_bar"][w, k]), float(steps["fill_price"][w, k])
            if steps["traded"][w, k]:
                if trade is not None:
                    flat = target == 0
                    trade["cost"] += cost if flat else 0.0
                    close_trade(fill_bar, fill_price, "signal", after if flat else before)
                    trade = None
                if target != 0:
                    trade = {"instrument": name, "entry_time": timestamps[fill_bar],
                             "exit_time": None, "entry_price": fill_price,
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



__all__ = ["trading_metrics", "trading_metrics_of_runs", "log_returns", "max_drawdowns",
           "valid_bars", "METRIC_KEYS", "ZERO_RISK", "portfolio_by_date", "portfolio_metrics",
           "metric_percentiles", "beat_percentile", "beat_percentiles", "evaluation_results",
           "trade_log", "PERCENTILES", "ACTIVITY_KEYS", "HIGHER_IS_BETTER", "LOWER_IS_BETTER",
           "TRADE_COLUMNS"]
