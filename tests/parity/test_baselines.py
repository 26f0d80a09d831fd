"""The random policies of the evaluation: one program of many walks, checked against float64
NumPy references (the reference simulator and a loop-built portfolio by date)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.config import EnvConfig
from foxhunt_jax.data.features import build_tables
from foxhunt_jax.data.market import MarketData
from foxhunt_jax.training import validate
from foxhunt_jax.training.metrics import ACTIVITY_KEYS, evaluation_results, trading_metrics
from reference_env import random_market, simulate

POLICIES = 200


def shifted_market(seed: int) -> MarketData:
    """Three instruments of different lengths whose dates start days apart (so a portfolio by
    date mixes bars that a mean by bar index would not)."""
    market = random_market(seed, lengths=(300, 260, 230), vol=0.02)
    moved = tuple(dataclasses.replace(ins, timestamps=ins.timestamps
                                      + np.timedelta64(3 * j, "D").astype("timedelta64[ns]"))
                  for j, ins in enumerate(market.instruments))
    return MarketData(moved, market.bar_seconds, market.bars_per_year)


@pytest.fixture(scope="module")
def walked():
    """200 random policies walking the test split of every instrument, in one jitted call."""
    market = shifted_market(3)
    tables = build_tables(market, (0.5, 0.25, 0.25), episode_length=10)
    # a high ruin floor so that some walks end early
    env_cfg = EnvConfig(episode_length=10, ruin_floor=0.93, cost_bps=5.0)
    params, starts, lengths = validate.evaluation_params(tables, env_cfg, "test")
    steps = int(lengths.max())
    run = jax.jit(lambda p, k, s, n: validate.random_walks(p, s, steps, k, n,
                                                           env_cfg.branch_sizes, POLICIES))
    walks = validate.walk_paths(run(params, jax.random.key(11), jnp.asarray(starts),
                                    jnp.asarray(lengths)))
    return market, tables, env_cfg, starts, lengths, walks


def reference_paths(tables, env_cfg, starts, lengths, actions):
    """Float64 equity [P, W, L+1], exposure, fills and turnover of the given actions
    [P, W, L, B] (tests/reference_env.py), each walk ending after its last bar or its ruin."""
    p_count, w_count, steps = actions.shape[:3]
    equity = np.full((p_count, w_count, steps + 1), np.nan)
    exposure = np.zeros((p_count, w_count, steps))
    fills = np.zeros((p_count, w_count, steps), np.int64)
    turnover = np.zeros((p_count, w_count, steps))
    for w in range(w_count):
        n = int(lengths[w])
        ref = simulate(tables, env_cfg, np.full(p_count, starts[w]), actions[:, w, :n])
        for p in range(p_count):
            ruin = np.flatnonzero(ref["terminated"][:, p])
            end = int(ruin[0]) + 1 if ruin.size else n
            equity[p, w, 0] = 1.0
            equity[p, w, 1:end + 1] = ref["equity"][:end, p]
            exposure[p, w, :end] = np.asarray(env_cfg.exposures)[actions[p, w, :end, 0]]
            fills[p, w, :end] = ref["fills"][:end, p]
            turnover[p, w, :end] = ref["turnover"][:end, p]
    return equity, exposure, fills, turnover


def loop_portfolio_curve(equity, bar_dates):
    """Equal weight by date over the walks with a finite bar ending on it, in Python loops."""
    by_date = {min(d[0] for d in bar_dates): []}
    for w, d in enumerate(bar_dates):
        for j in range(1, len(d)):
            a, b = equity[w][j - 1], equity[w][j]
            by_date.setdefault(d[j], [])
            if math.isfinite(a) and math.isfinite(b):
                by_date[d[j]].append(b / a - 1.0)
    curve = [1.0]
    for d in sorted(by_date)[1:]:
        rows = by_date[d]
        curve.append(curve[-1] * (1.0 + (sum(rows) / len(rows) if rows else 0.0)))
    return np.array(curve)


def test_random_policies_draw_the_exploration_distribution(walked):
    _, _, env_cfg, _, lengths, walks = walked
    alive = np.isfinite(walks["equity"][..., 1:])
    assert alive.sum() > 0.5 * POLICIES * lengths.sum()  # most walks run to their end
    assert not alive.all()  # the ruin floor ended some
    for branch, n in enumerate(env_cfg.branch_sizes):
        drawn = walks["action"][..., branch][alive]
        counts = np.bincount(drawn, minlength=n)
        expected = drawn.size / n
        # uniform: every action within 5 standard deviations of its expected count
        assert np.all(np.abs(counts - expected) < 5 * math.sqrt(expected)), (branch, counts)
    # the policies differ from each other
    assert len({walks["action"][p, 0, :5].tobytes() for p in range(POLICIES)}) > POLICIES // 2


def test_random_percentiles_equal_float64_reference(walked):
    market, tables, env_cfg, starts, lengths, walks = walked
    dates = validate.walk_dates(tables.timestamps, starts, lengths)
    ref_eq, ref_x, ref_fills, ref_turnover = reference_paths(tables, env_cfg, starts, lengths,
                                                             walks["action"])
    np.testing.assert_array_equal(np.isfinite(walks["equity"]), np.isfinite(ref_eq))
    np.testing.assert_allclose(walks["equity"], ref_eq, rtol=2e-5)

    # the agent: one of the random walks, so its percentile is known
    agent = {k: walks[k][7] for k in ("equity", "exposure", "traded", "trades", "turnover")}
    paths = {"agent": agent, "flat": validate.flat_paths(lengths)}
    # the instruments with a test window (the calendar cut may leave one without)
    names = [f"i{int(tables.instrument[s])}" for s in starts]
    res = evaluation_results(paths, walks, dates, names, market.bars_per_year)

    curves = np.stack([loop_portfolio_curve(ref_eq[p], dates) for p in range(POLICIES)])
    samples = []
    for p in range(POLICIES):
        curve = trading_metrics(curves[p], np.zeros(curves.shape[1] - 1),
                                np.zeros(curves.shape[1] - 1), market.bars_per_year)
        pooled = trading_metrics(ref_eq[p], ref_x[p], ref_fills[p], market.bars_per_year,
                                 turnover=ref_turnover[p])
        samples.append({k: pooled[k] if k in ACTIVITY_KEYS else v for k, v in curve.items()})
    random = res["metrics"]["random"]
    assert random["policies"] == POLICIES
    for key in samples[0]:
        values = np.array([s[key] for s in samples])
        for q in (5, 50, 95):
            assert random[f"p{q}"][key] == pytest.approx(np.percentile(values, q), rel=1e-4,
                                                         abs=1e-6), (key, q)
    for q in (5, 50, 95):  # the band, date by date
        np.testing.assert_allclose(res["curves"][f"random_p{q}"],
                                   np.percentile(curves, q, axis=0), rtol=1e-4)
    np.testing.assert_allclose(res["curves"]["agent"], curves[7], rtol=1e-4)
    sharpe = np.array([s["sharpe"] for s in samples])
    beaten = np.sum(sharpe < sharpe[7]) + 0.5 * np.sum(sharpe == sharpe[7])
    assert res["metrics"]["agent_percentile"]["sharpe"] == pytest.approx(100 * beaten / POLICIES)
    # flat: in cash throughout
    assert res["metrics"]["flat"]["total_return"] == 0.0 and res["metrics"]["flat"]["trades"] == 0
    np.testing.assert_array_equal(res["curves"]["flat"], 1.0)
    assert set(res["metrics"]["per_instrument"]) == {"agent"}
    assert list(res["metrics"]["per_instrument"]["agent"]) == names


@pytest.mark.parametrize("fill", ["next_open", "close"])
def test_buy_and_hold_fills_by_the_env_rule(fill):
    rng = np.random.default_rng(3)
    close = np.exp(np.cumsum(rng.normal(0, 0.01, 30))) * 50
    opens = close * np.exp(rng.normal(0, 0.003, 30))
    tables = SimpleNamespace(close=close.astype(np.float32), open=opens.astype(np.float32))
    env_cfg = EnvConfig(fill=fill, cost_bps=7.0, slippage_bps=3.0)
    starts, lengths = np.array([2, 10]), np.array([9, 5])
    got = validate.buy_and_hold_paths(tables, env_cfg, starts, lengths)
    for w, (s, n) in enumerate(zip(starts, lengths)):
        price = float(opens.astype(np.float32)[s + 1]) if fill == "next_open" else float(
            close.astype(np.float32)[s])
        units = 1.0 / (price * 1.0003 * 1.0007)
        want = units * close.astype(np.float32)[s + 1:s + n + 1].astype(np.float64)
        np.testing.assert_allclose(got["equity"][w, 1:n + 1], want, rtol=1e-12)
        assert got["equity"][w, 0] == 1.0 and np.all(np.isnan(got["equity"][w, n + 1:]))
        assert got["trades"][w].sum() == 1 and got["exposure"][w, :n].tolist() == [1.0] * n
