"""Trading metrics against hand-computed values and an independent per-bar loop."""

from __future__ import annotations

import math

import numpy as np
import pytest

from foxhunt_jax.training.metrics import (ACTIVITY_KEYS, METRIC_KEYS, beat_percentile,
                                          beat_percentiles, max_drawdowns, metric_percentiles,
                                          portfolio_by_date, portfolio_metrics, trading_metrics,
                                          trading_metrics_of_runs)


def loop_metrics(equity, exposure, trades, bars_per_year):
    """Straightforward reference: Python loops over windows and bars, math module only."""
    rets, dds, totals = [], [], []
    moves, bars, in_mkt, wins, n_trades = 0.0, 0, 0, 0, 0
    for w in range(len(equity)):
        path = []
        for v in equity[w]:
            if not math.isfinite(v):
                break
            path.append(float(v))
        totals.append(path[-1] / path[0] - 1.0)
        peak, worst = path[0], 0.0
        for v in path:
            peak = max(peak, v)
            worst = max(worst, 1.0 - v / peak)
        dds.append(worst)
        prev_x = 0.0
        for t in range(len(path) - 1):
            r = math.log(path[t + 1] / path[t])
            rets.append(r)
            x = float(exposure[w][t])
            moves += abs(x - prev_x)
            prev_x = x
            bars += 1
            if x != 0:
                in_mkt += 1
                wins += r > 0
            if np.ndim(trades) == 2:
                n_trades += int(trades[w][t])
        if np.ndim(trades) == 1:
            n_trades += int(trades[w])
    n = len(rets)
    mean = sum(rets) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rets) / n)
    down = math.sqrt(sum(min(r, 0.0) ** 2 for r in rets) / n)
    ann = math.exp(bars_per_year * mean) - 1
    mdd = sum(dds) / len(dds)
    a = math.sqrt(bars_per_year)
    return {
        "total_return": sum(totals) / len(totals),
        "annualized_return": ann,
        "annualized_volatility": std * a,
        "sharpe": mean / std * a if std > 1e-12 else 0.0,
        "sortino": mean / down * a if down > 1e-12 else 0.0,
        "max_drawdown": mdd,
        "max_drawdown_worst": max(dds),
        "calmar": ann / mdd if mdd > 1e-12 else 0.0,
        "turnover": moves / bars,
        "trades": n_trades,
        "hit_rate": wins / in_mkt if in_mkt else 0.0,
        "time_in_market": in_mkt / bars,
        "bars": bars,
    }


def assert_metrics_close(got, want, rtol=1e-9):
    assert set(got) == set(METRIC_KEYS) == set(want)
    for k in METRIC_KEYS:
        assert got[k] == pytest.approx(want[k], rel=rtol, abs=1e-12), k
    assert isinstance(got["trades"], int) and isinstance(got["bars"], int)
    assert all(isinstance(got[k], float) for k in METRIC_KEYS if k not in ("trades", "bars"))


def test_double_then_halve_by_hand():
    equity = np.array([[1.0, 2.0, 1.0]])
    exposure = np.array([[1.0, 1.0]])
    m = trading_metrics(equity, exposure, np.array([1]), bars_per_year=252.0)
    assert m["max_drawdown"] == pytest.approx(0.5)
    assert m["max_drawdown_worst"] == pytest.approx(0.5)
    assert m["total_return"] == pytest.approx(0.0)
    # returns +log2, -log2: mean 0, std log2 -> sharpe 0, annualized return 0, calmar 0
    assert m["sharpe"] == pytest.approx(0.0, abs=1e-12)
    assert m["annualized_volatility"] == pytest.approx(math.log(2) * math.sqrt(252))
    assert m["annualized_return"] == pytest.approx(0.0, abs=1e-12)
    assert m["calmar"] == pytest.approx(0.0, abs=1e-12)
    assert m["hit_rate"] == pytest.approx(0.5)
    assert m["time_in_market"] == 1.0
    assert m["turnover"] == pytest.approx(0.5)  # 0 -> 1 once over two bars
    assert m["trades"] == 1 and m["bars"] == 2


def test_two_windows_by_hand():
    # window 0: 1 -> 1.1 -> 0.99 -> 1.21 ; window 1: 1 -> 0.9 then ends (NaN padded)
    equity = np.array([[1.0, 1.1, 0.99, 1.21], [1.0, 0.9, np.nan, np.nan]])
    exposure = np.array([[1.0, -0.5, 0.0], [0.5, 1.0, 1.0]])
    flags = np.array([[1, 1, 1], [1, 1, 0]])
    m = trading_metrics(equity, exposure, flags, bars_per_year=4.0)
    r = [math.log(1.1), math.log(0.9), math.log(1.21 / 0.99), math.log(0.9)]
    mean = sum(r) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in r) / 4)
    down = math.sqrt((2 * math.log(0.9) ** 2) / 4)
    assert m["bars"] == 4
    assert m["total_return"] == pytest.approx((0.21 - 0.1) / 2)
    assert m["sharpe"] == pytest.approx(mean / std * 2.0)
    assert m["sortino"] == pytest.approx(mean / down * 2.0)
    assert m["annualized_return"] == pytest.approx(math.exp(4 * mean) - 1)
    assert m["max_drawdown"] == pytest.approx((0.1 + 0.1) / 2)  # 1.1 -> 0.99 and 1 -> 0.9
    # in market: w0 bars 0, 1 (r>0, r<0); w1 bar 0 (r<0) -> 1 win of 3
    assert m["hit_rate"] == pytest.approx(1 / 3)
    assert m["time_in_market"] == pytest.approx(3 / 4)
    # |1-0| + |-0.5-1| + |0+0.5| + |0.5-0| = 3.5 over 4 bars
    assert m["turnover"] == pytest.approx(3.5 / 4)
    assert m["trades"] == 4  # flags on valid bars only


def test_zero_variance_gives_zero_not_nan():
    for path in ([1.0] * 6, [1.01 ** k for k in range(6)]):
        m = trading_metrics(np.array([path]), np.zeros((1, 5)), np.zeros(1), 252.0)
        assert all(np.isfinite(float(m[k])) for k in METRIC_KEYS)
        assert m["sharpe"] == 0.0 and m["sortino"] == 0.0
        assert m["max_drawdown"] == 0.0 and m["calmar"] == 0.0
        assert m["hit_rate"] == 0.0 and m["time_in_market"] == 0.0


def test_single_window_1d_inputs_equal_2d():
    rng = np.random.default_rng(3)
    eq = np.cumprod(np.r_[1.0, np.exp(rng.normal(0, 0.01, 30))])
    x = rng.choice([-1.0, 0.0, 1.0], 30)
    flags = rng.integers(0, 2, 30)
    one = trading_metrics(eq, x, flags, 252.0)
    assert one == trading_metrics(eq[None], x[None], flags[None], 252.0)


@pytest.mark.parametrize("seed", range(6))
def test_random_paths_match_loop(seed):
    rng = np.random.default_rng(seed)
    w, t = int(rng.integers(1, 6)), int(rng.integers(2, 40))
    r = rng.normal(0.0005, 0.02, (w, t))
    equity = np.concatenate([np.ones((w, 1)), np.cumprod(np.exp(r), axis=1)], axis=1)
    equity *= rng.uniform(0.5, 2.0, (w, 1))  # initial equity need not be 1
    lengths = rng.integers(1, t + 1, w)  # windows end early and are NaN-padded
    for i, n in enumerate(lengths):
        equity[i, n + 1:] = np.nan
    exposure = rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], (w, t))
    exposure[rng.random((w, t)) < 0.1] = np.nan  # values past the end are ignored; inside: 0
    exposure_ref = np.nan_to_num(exposure)
    if seed % 2:
        trades = rng.integers(0, 2, (w, t))
    else:
        trades = rng.integers(0, 9, w)
    bpy = float(rng.uniform(50, 10000))
    got = trading_metrics(equity, exposure, trades, bpy)
    assert_metrics_close(got, loop_metrics(equity, exposure_ref, trades, bpy))


@pytest.mark.parametrize("seed", range(4))
def test_runs_at_once_equal_each_run_alone(seed):
    """trading_metrics_of_runs (a population's members, random policies) is trading_metrics of
    each run, up to float rounding: NaN-padded windows, both trade layouts, turnover given or
    derived, a run with no valid bar beside runs with many, runs in several passes."""
    rng = np.random.default_rng(100 + seed)
    # more runs than one pass takes (RUNS_AT_ONCE) in the last case
    runs, w, t = (1, 3, 6, 19)[seed], int(rng.integers(1, 5)), int(rng.integers(2, 30))
    r = rng.normal(0.0005, 0.02, (runs, w, t))
    equity = np.concatenate([np.ones((runs, w, 1)), np.cumprod(np.exp(r), axis=2)], axis=2)
    equity *= rng.uniform(0.5, 2.0, (runs, w, 1))
    ends = rng.integers(1, t + 1, (runs, w))
    equity[np.arange(t + 1)[None, None, :] > ends[..., None]] = np.nan
    equity[0, :, 1:] = np.nan  # the first run has no valid bar at all
    exposure = rng.choice([-1.0, 0.0, 0.5, 1.0], (runs, w, t))
    exposure[rng.random((runs, w, t)) < 0.1] = np.nan
    trades = rng.integers(0, 3, (runs, w, t)) if seed % 2 else rng.integers(0, 9, (runs, w))
    turnover = rng.uniform(0.0, 1.0, (runs, w, t)) if seed % 3 == 0 else None
    bpy = float(rng.uniform(50, 10000))
    got = trading_metrics_of_runs(equity, exposure, trades, bpy, turnover=turnover)
    assert len(got) == runs
    for i in range(runs):
        alone = trading_metrics(equity[i], exposure[i], trades[i], bpy,
                                turnover=None if turnover is None else turnover[i])
        assert_metrics_close(got[i], alone, rtol=1e-12)
    assert got[0]["bars"] == 0 and got[0]["sharpe"] == 0.0


def test_runs_at_once_reject_a_mismatched_run_axis():
    with pytest.raises(ValueError, match="must be"):
        trading_metrics_of_runs(np.ones((2, 3, 5)), np.zeros((3, 4)), np.zeros((2, 3)), 252.0)
    with pytest.raises(ValueError, match="trades shape"):
        trading_metrics_of_runs(np.ones((2, 3, 5)), np.zeros((2, 3, 4)), np.zeros((3, 3)), 252.0)


def test_max_drawdown_ignores_padding_and_later_values():
    equity = np.array([[1.0, 3.0, 1.5, np.nan, 0.1], [2.0, 1.0, 4.0, 3.0, 1.0]])
    np.testing.assert_allclose(max_drawdowns(equity), [0.5, 0.75])


def test_total_loss_is_finite_large_loss():
    m = trading_metrics(np.array([[1.0, 0.5, 0.0]]), np.ones((1, 2)), np.ones(1), 252.0)
    assert m["total_return"] == -1.0 and m["max_drawdown"] == 1.0
    assert np.isfinite(m["sharpe"]) and m["annualized_return"] == pytest.approx(-1.0)


@pytest.mark.parametrize("bad", [
    dict(exposure=np.zeros((3, 3))),
    dict(trades=np.zeros(5)),
    dict(bpy=0.0),
    dict(equity=np.array([[np.nan, 1.0, 1.0, 1.0], [1.0] * 4])),
])
def test_bad_shapes_raise(bad):
    args = dict(equity=np.ones((2, 4)), exposure=np.zeros((2, 3)), trades=np.zeros(2), bpy=252.0)
    args.update(bad)
    with pytest.raises(ValueError):
        trading_metrics(args["equity"], args["exposure"], args["trades"], args["bpy"])


# ---------------------------------------------------------------------------------------------
# the equal-weight portfolio by date, percentiles and the agent's percentile


def loop_portfolio(equity, exposure, traded, bar_dates):
    """Reference portfolio: a dict from date to the instruments' one-bar returns ending on it,
    built with Python loops; the curve compounds their plain mean date by date."""
    by_date = {min(d[0] for d in bar_dates): []}
    for w, d in enumerate(bar_dates):
        for j in range(1, len(d)):
            by_date.setdefault(d[j], [])
            a, b = float(equity[w][j - 1]), float(equity[w][j])
            if math.isfinite(a) and math.isfinite(b):
                by_date[d[j]].append((b / a - 1.0, float(exposure[w][j - 1]),
                                      float(traded[w][j - 1])))
    dates = sorted(by_date)
    curve, held, trades = [1.0], [], []
    for d in dates[1:]:
        rows = by_date[d]
        mean = lambda i: sum(r[i] for r in rows) / len(rows) if rows else 0.0  # noqa: E731
        curve.append(curve[-1] * (1.0 + mean(0)))
        held.append(mean(1))
        trades.append(sum(r[2] for r in rows))
    return np.array(dates), np.array(curve), np.array(held), np.array(trades)


def random_walk_set(rng, w=3, t=25, ruin=True):
    """``w`` walks of different lengths on dates that start apart and skip days differently;
    equity ``[w, t+1]`` NaN after each walk ends (one ends early, as a ruined walk does)."""
    lengths = rng.integers(5, t + 1, w)
    lengths[0] = t
    dates = []
    for i, n in enumerate(lengths):
        steps = rng.integers(1, 3, n + 1).astype("timedelta64[D]")  # some days are skipped
        dates.append(np.datetime64("2020-01-01") + int(rng.integers(0, 10))
                     * np.timedelta64(1, "D") + np.cumsum(steps))
    equity = np.full((w, t + 1), np.nan)
    for i, n in enumerate(lengths):
        equity[i, :n + 1] = np.cumprod(np.r_[1.0, np.exp(rng.normal(0, 0.02, n))])
    if ruin:
        equity[w - 1, int(lengths[-1]) // 2 + 1:] = np.nan
    exposure = rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], (w, t))
    traded = rng.integers(0, 2, (w, t)).astype(bool)
    return equity, exposure, traded, dates


@pytest.mark.parametrize("seed", range(4))
def test_portfolio_by_date_matches_loop(seed):
    rng = np.random.default_rng(seed + 10)
    equity, exposure, traded, dates = random_walk_set(rng)
    got = portfolio_by_date(equity, exposure, traded, dates)
    want_dates, curve, held, trades = loop_portfolio(equity, exposure, traded, dates)
    np.testing.assert_array_equal(got["dates"], want_dates)
    np.testing.assert_allclose(got["equity"], curve, rtol=1e-12)
    np.testing.assert_allclose(got["exposure"], held, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(got["trades"], trades)


def test_portfolio_by_date_by_hand():
    # A marks 1 -> 1.1 -> 1.21 on days 1, 2, 3; B starts on day 2: 1 -> 0.9 on day 3, then
    # 0.9 -> 0.99 on day 4 (A has ended): day 2 A +10%; day 3 mean(+10%, -10%) = 0; day 4 B +10%
    d = lambda *days: np.array([np.datetime64("2020-01-01") + k for k in days])  # noqa: E731
    equity = np.array([[1.0, 1.1, 1.21], [1.0, 0.9, 0.99]])
    exposure = np.array([[1.0, 1.0], [-1.0, 0.0]])
    got = portfolio_by_date(equity, exposure, np.ones((2, 2)), [d(0, 1, 2), d(1, 2, 3)])
    np.testing.assert_array_equal(got["dates"], d(0, 1, 2, 3))
    np.testing.assert_allclose(got["equity"], [1.0, 1.1, 1.1, 1.21])
    np.testing.assert_allclose(got["exposure"], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(got["instruments"], [1, 2, 1])


def test_portfolio_by_date_leading_axes_are_separate_portfolios():
    rng = np.random.default_rng(7)
    sets = [random_walk_set(np.random.default_rng(7)) for _ in range(3)]
    dates = sets[0][3]
    eq = np.stack([s[0] * np.exp(rng.normal(0, 0.01, s[0].shape)) for s in sets])
    x, tr = np.stack([s[1] for s in sets]), np.stack([s[2] for s in sets])
    got = portfolio_by_date(eq, x, tr, dates)
    for p in range(3):
        one = portfolio_by_date(eq[p], x[p], tr[p], dates)
        np.testing.assert_allclose(got["equity"][p], one["equity"], rtol=1e-12)
        np.testing.assert_allclose(got["exposure"][p], one["exposure"], rtol=1e-12)


def test_portfolio_metrics_are_the_curve_s_with_pooled_activity():
    rng = np.random.default_rng(8)
    equity, exposure, traded, dates = random_walk_set(rng)
    portfolio = portfolio_by_date(equity, exposure, traded, dates)
    # turnover as the exposure moves, which the loop reference counts
    moves = np.abs(np.diff(np.nan_to_num(exposure), axis=-1, prepend=0.0))
    paths = {"equity": equity, "exposure": exposure, "trades": traded, "turnover": moves}
    got = portfolio_metrics(portfolio, paths, 252.0)
    curve = loop_metrics(portfolio["equity"][None], portfolio["exposure"][None],
                         portfolio["trades"][None], 252.0)
    pooled = loop_metrics(equity, exposure, traded, 252.0)
    want = {k: pooled[k] if k in ACTIVITY_KEYS else curve[k] for k in METRIC_KEYS}
    assert_metrics_close(got, want, rtol=1e-9)
    assert got["total_return"] == pytest.approx(portfolio["equity"][-1] - 1.0, rel=1e-12)


def test_percentiles_and_beat_percentile():
    rng = np.random.default_rng(9)
    samples = [{"sharpe": float(v), "max_drawdown": float(d), "trades": int(n)}
               for v, d, n in zip(rng.normal(size=41), rng.uniform(size=41),
                                  rng.integers(0, 50, 41))]
    got = metric_percentiles(samples)
    for key in ("sharpe", "max_drawdown", "trades"):
        values = sorted(s[key] for s in samples)
        # with 41 samples the 5th/50th/95th percentiles fall on samples 2, 20 and 38
        assert [got[q][key] for q in ("p5", "p50", "p95")] == [values[2], values[20], values[38]]
    # ties count half; a lower drawdown beats a higher one; trades has no better side
    ties = [{"sharpe": v, "max_drawdown": v, "trades": 1} for v in (0.1, 0.2, 0.2, 0.3)]
    assert beat_percentile(0.2, ties, "sharpe") == pytest.approx(100 * (1 + 0.5 * 2) / 4)
    assert beat_percentile(0.2, ties, "max_drawdown") == pytest.approx(100 * (1 + 0.5 * 2) / 4)
    assert beat_percentile(0.35, ties, "sharpe") == 100.0
    assert beat_percentile(0.35, ties, "max_drawdown") == 0.0
    assert beat_percentiles({"sharpe": 0.35, "max_drawdown": 0.05, "trades": 3}, ties) == {
        "sharpe": 100.0, "max_drawdown": 100.0}
