"""Property tests of the trading env on real bars (hypothesis; one jitted function for all cases).

Costs, slippage, the ruin floor, the fill mode and the action mix vary per example; costs,
slippage and floor are traced parameters, so every example reuses one of two compiled programs
(one per fill mode).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt_jax.config import FILLS, EnvConfig
from foxhunt_jax.data.features import build_tables
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.env import trading

N, STEPS = 32, 40
CFG = EnvConfig(episode_length=STEPS, time_barrier=5)
FLAT = CFG.exposures.index(0.0)
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


@jax.jit
def run(params, starts, actions):
    """starts [N], actions [N, STEPS, B] -> per-step arrays [STEPS, N] (no auto-reset)."""
    _, state = jax.vmap(trading.reset_at, in_axes=(0, None))(starts, params)
    step_v = jax.vmap(trading.step_env, in_axes=(None, 0, 0, None))

    def body(state, a):
        before = {"units_before": state.units, "equity_before": state.equity,
                  "exposure_before": state.exposure, "bar": state.bar}
        _, state, reward, term, trunc, info = step_v(jax.random.key(0), state, a, params)
        return state, dict(info, **before, reward=reward, terminated=term, truncated=trunc,
                           units_after=state.units, exposure_after=state.exposure)

    return jax.lax.scan(body, state, jnp.swapaxes(actions, 0, 1))[1]


@pytest.fixture(scope="module")
def env():
    tables = build_tables(load_market(["builtin:us_stocks_daily"]), episode_length=STEPS)
    return tables, {fill: trading.make_params(tables, dataclasses.replace(CFG, fill=fill), "train")
                    for fill in FILLS}


@st.composite
def cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    p_flat = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    p_keep = draw(st.floats(0.0, 0.95))
    cost_bps = draw(st.floats(0.5, 50.0))
    fixed_cost = draw(st.sampled_from([0.0, 1e-4, 1e-3]))
    ruin_floor = draw(st.floats(0.5, 0.995))
    fill = draw(st.sampled_from(FILLS))
    slippage_bps = draw(st.sampled_from([0.0, 0.5, 5.0]))
    return seed, p_flat, p_keep, cost_bps, fixed_cost, ruin_floor, fill, slippage_bps


def _simulate_case(env, case):
    tables, params_of = env
    seed, p_flat, p_keep, cost_bps, fixed_cost, ruin_floor, fill, slippage_bps = case
    params = params_of[fill]
    rng = np.random.default_rng(seed)
    sizes = CFG.branch_sizes
    acts = np.stack([rng.integers(0, k, (N, STEPS)) for k in sizes], axis=-1)
    acts[rng.random((N, STEPS)) < p_flat, 0] = FLAT
    for j in range(1, STEPS):
        keep = rng.random(N) < p_keep
        acts[keep, j, 0] = acts[keep, j - 1, 0]
    starts = rng.choice(tables.starts["train"], N)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    p = params.replace(cost_rate=f32(cost_bps / 1e4), fixed_cost=f32(fixed_cost),
                       ruin_floor=f32(ruin_floor), slippage_rate=f32(slippage_bps / 1e4))
    out = jax.tree.map(np.asarray, run(p, jnp.asarray(starts, jnp.int32),
                                       jnp.asarray(acts, jnp.int32)))
    return out, acts, ruin_floor


@SETTINGS
@given(case=cases())
def test_flat_and_zero_exposure_earns_nothing(env, case):
    out, acts, _ = _simulate_case(env, case)
    idle = (out["units_before"] == 0) & (acts[:, :, 0].T == FLAT)
    np.testing.assert_array_equal(out["equity"][idle], out["equity_before"][idle])
    assert np.all(out["cost"][idle] == 0) and np.all(out["reward"][idle] == 0)
    assert not out["traded"][idle].any() and np.all(out["barrier"][idle] == 0)
    if case[1] == 1.0:  # every action flat: the equity never moves from 1
        assert np.all(out["equity"] == 1.0) and np.all(out["units_after"] == 0)


@SETTINGS
@given(case=cases())
def test_costs_only_on_trades_and_exits(env, case):
    out, _, _ = _simulate_case(env, case)
    charged = out["traded"] | (out["barrier"] != 0)
    np.testing.assert_array_equal(out["cost"] > 0, charged)
    assert np.all(out["cost"] >= 0)
    # the reward is the scaled log growth of equity, costs included
    np.testing.assert_allclose(out["reward"], CFG.reward_scale * np.log(
        out["equity"].astype(np.float64) / out["equity_before"]), atol=1e-4)


@SETTINGS
@given(case=cases())
def test_exits_inside_the_next_bar(env, case):
    tables, _ = env
    out, _, _ = _simulate_case(env, case)
    slip = case[-1] / 1e4
    hit = out["barrier"] != 0
    nxt = out["bar"] + 1
    lo, hi, close = tables.low[nxt], tables.high[nxt], tables.close[nxt]
    # an exit executes inside bar t+1's range, moved by at most the slippage
    px = out["exit_price"].astype(np.float64)
    assert np.all(px[hit] >= lo[hit] * (1 - slip) * (1 - 1e-6))
    assert np.all(px[hit] <= hi[hit] * (1 + slip) * (1 + 1e-6))
    at_close = (out["barrier"] == trading.TIME) | (out["barrier"] == trading.RUIN)
    np.testing.assert_allclose(np.abs(px[at_close] / close[at_close] - 1), slip, atol=1e-6)
    assert np.all(out["exit_price"][~hit] == 0)
    assert np.all(out["units_after"][hit] == 0)


@SETTINGS
@given(case=cases())
def test_fills_and_turnover_count_every_position_change(env, case):
    out, acts, _ = _simulate_case(env, case)
    exited = out["barrier"] != 0
    np.testing.assert_array_equal(out["fills"], out["traded"].astype(int) + exited)
    # the exposure after the chosen trade is the chosen one; an exit moves it to 0
    chosen = np.asarray(CFG.exposures, np.float32)[acts[:, :, 0].T]
    want = np.where(out["traded"], np.abs(chosen - out["exposure_before"]), 0) \
        + np.where(exited, np.abs(chosen), 0)
    np.testing.assert_allclose(out["turnover"], want, rtol=1e-6)
    # every change of the held position between steps is one or more fills
    changed = out["exposure_after"] != out["exposure_before"]
    assert np.all(out["fills"][changed] >= 1)


@SETTINGS
@given(case=cases())
def test_equity_above_floor_until_ruin(env, case):
    out, _, ruin_floor = _simulate_case(env, case)
    alive = ~out["terminated"]
    floor = np.float32(ruin_floor)
    assert np.all(out["equity"][alive] >= floor) and floor > 0
    assert np.all(out["equity"][out["terminated"]] < floor)
    # before its first ruin, an episode's equity is positive and finite at every step
    before_ruin = np.cumsum(out["terminated"], axis=0) == 0
    assert np.all(np.isfinite(out["equity"])) and np.all(out["equity"][before_ruin] > 0)
    np.testing.assert_array_equal(out["truncated"][-1], ~out["terminated"][-1])
    assert not out["truncated"][:-1].any()


def test_padded_params_draw_and_step_as_the_tables_do(env):
    """``make_params`` pads the tables and the starts to ``padded_size``: ``start_bar`` draws
    from the real starts what a draw over them alone gives, and the padded rows repeat the last
    bar (what a clamped read past it saw)."""
    tables, params_of = env
    params = params_of["next_open"]
    starts = np.asarray(tables.starts["train"])
    assert params.starts.shape[0] == trading.padded_size(len(tables.close)) > len(starts)
    assert int(params.num_starts) == len(starts)
    keys = jax.random.split(jax.random.key(int(np.random.default_rng().integers(1 << 30))), 500)
    drawn = jax.vmap(trading.start_bar, in_axes=(0, None))(keys, params)
    alone = jax.vmap(lambda k: jnp.asarray(starts)[jax.random.randint(k, (), 0, len(starts))])(keys)
    np.testing.assert_array_equal(drawn, alone)
    t = len(tables.close)
    assert params.close.shape[0] == trading.padded_size(t) > t
    np.testing.assert_array_equal(params.close[:t], np.asarray(tables.close, np.float32))
    assert np.all(np.asarray(params.features[t:]) == np.asarray(tables.features[-1], np.float32))
