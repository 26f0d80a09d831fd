"""The jitted, vmapped trading env against the float64 reference simulator, and hand-built cases."""

from __future__ import annotations

import dataclasses
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.config import EnvConfig
from foxhunt_jax.data.features import MarketTables, build_tables
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.env import trading
from foxhunt_jax.env.gymnax_env import param_branch_sizes
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.training import validate
from foxhunt_jax.training.metrics import trading_metrics
from reference_env import simulate

KEY = jax.random.key(0)


@jax.jit
def run_fixed(params, starts, actions):
    """starts [N], actions [N, L, B] -> per-step outputs [L, N] (no auto-reset)."""
    _, state = jax.vmap(trading.reset_at, in_axes=(0, None))(starts, params)
    step_v = jax.vmap(trading.step_env, in_axes=(None, 0, 0, None))
    port_v = jax.vmap(trading.portfolio_obs, in_axes=(0, None))

    def body(state, a):
        portfolio = port_v(state, params)
        obs, state, reward, term, trunc, info = step_v(KEY, state, a, params)
        return state, dict(info, reward=reward, terminated=term, truncated=trunc,
                           portfolio=portfolio, obs=obs)

    return jax.lax.scan(body, state, jnp.swapaxes(actions, 0, 1))[1]


def sticky_actions(rng, sizes, n, steps, p_keep=0.7):
    """[n, steps, B] random actions; the exposure repeats with probability p_keep so that
    positions live long enough to meet their barriers."""
    acts = np.stack([rng.integers(0, k, (n, steps)) for k in sizes], axis=-1)
    for j in range(1, steps):
        keep = rng.random(n) < p_keep
        acts[keep, j, 0] = acts[keep, j - 1, 0]
    return acts.astype(np.int32)


_TABLES: dict = {}


def real_tables(name: str):
    """build_tables of builtin:NAME with L = 100, built once per test session."""
    if name not in _TABLES:
        _TABLES[name] = build_tables(load_market([f"builtin:{name}"]), episode_length=100)
    return _TABLES[name]


@pytest.fixture(scope="module")
def us_tables():
    return real_tables("us_stocks_daily")


# name -> (config, dataset, split); each runs under both fill modes
CASES = {
    "default": (EnvConfig(), "us_stocks_daily", "train"),
    "default_fx_slippage": (EnvConfig(slippage_bps=3.0), "eurusd_hourly", "validation"),
    "one_branch_fixed_cost": (EnvConfig(take_profit=(), stop_loss=(), fixed_cost=1e-3,
                                        cost_bps=5.0), "us_stocks_daily", "test"),
    "short_time_barrier_tp_only": (EnvConfig(stop_loss=(), time_barrier=2, cost_bps=10.0,
                                             take_profit=(0.5, 1.5), slippage_bps=1.0),
                                   "us_stocks_daily", "train"),
    "sl_only_tight": (EnvConfig(take_profit=(), stop_loss=(0.5, 1.0), time_barrier=1,
                                exposures=(-1.0, 1.0), fixed_cost=2e-4, ruin_floor=0.9),
                      "us_stocks_daily", "test"),
}


@pytest.mark.parametrize("fill", ["next_open", "close"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_on_real_data(name, fill):
    cfg, data, split = CASES[name]
    cfg = dataclasses.replace(cfg, fill=fill)
    tables = real_tables(data)
    params = trading.make_params(tables, cfg, split)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    n, steps = 256, 100
    starts = rng.choice(tables.starts[split], n)
    acts = sticky_actions(rng, cfg.branch_sizes, n, steps)
    dev = jax.tree.map(np.asarray, run_fixed(params, jnp.asarray(starts), jnp.asarray(acts)))
    ref = simulate(tables, cfg, starts, acts)

    chex.assert_shape([dev["equity"], dev["reward"], dev["cost"]], (steps, n))
    chex.assert_type([dev["equity"], dev["reward"], dev["cost"], dev["exit_price"],
                      dev["turnover"]], np.float32)
    for k in ("barrier", "traded", "fills", "terminated", "truncated"):
        np.testing.assert_array_equal(dev[k], ref[k], err_msg=k)
    np.testing.assert_allclose(dev["equity"], ref["equity"], rtol=1e-5)
    np.testing.assert_allclose(dev["exit_price"], ref["exit_price"], rtol=1e-6)
    np.testing.assert_allclose(dev["cost"], ref["cost"], rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(dev["turnover"], ref["turnover"], rtol=1e-6)
    np.testing.assert_allclose(dev["reward"], ref["reward"], atol=2e-4)
    cols = [0, 1, 2, 5]
    np.testing.assert_allclose(dev["portfolio"][..., cols], ref["portfolio"][..., cols],
                               rtol=1e-4, atol=2e-4)
    # barrier distances divide a float32 price gap by sigma (down to 1e-4): one ulp of a
    # barrier level can move them by ~1e-3
    np.testing.assert_allclose(dev["portfolio"][..., 3:5], ref["portfolio"][..., 3:5], atol=1e-3)
    # the observation after each step is the next bar's feature row plus the next portfolio
    next_bars = starts[None, :] + np.arange(1, steps + 1)[:, None]
    np.testing.assert_array_equal(dev["obs"][:, :, :-trading.P], tables.features[next_bars])
    np.testing.assert_array_equal(dev["obs"][:-1, :, -trading.P:], dev["portfolio"][1:])
    # the run exercised the rules it checks
    codes = set(np.unique(ref["barrier"]).tolist())
    allowed = {0, 3, 4} | ({1} if cfg.take_profit else set()) | ({2} if cfg.stop_loss else set())
    required = (allowed - {0, 3, 4}) | ({3} if cfg.time_barrier <= 2 else set())
    assert required <= codes <= allowed, codes
    assert ref["truncated"][-1].sum() + ref["terminated"].any(0).sum() >= n
    if cfg.take_profit or cfg.stop_loss:  # a trade and an exit in one step, both counted
        assert (ref["fills"] == 2).any()
    if name == "sl_only_tight":
        assert ref["terminated"].any()


# ---------------------------------------------------------------------------------------------
# Hand-built bars. Every case uses 8 bars and the same static config (three branches, time
# barrier 1, L = 3), so the jitted step functions compile once; costs are traced parameters.

T_HAND = 8


def _tables(open_, high, low, close, sigma=0.01, episode_length=3):
    """One instrument of T_HAND bars (the given ones, then copies of the last), zero features."""
    cols = [np.resize(np.asarray(x, np.float32), T_HAND) for x in (open_, high, low, close)]
    for x, given in zip(cols, (open_, high, low, close)):
        x[len(given):] = given[-1]
    T = T_HAND
    starts = np.arange(0, T - episode_length, dtype=np.int32)
    seg = np.array([[0, T - 1]], np.int64)
    return MarketTables(
        features=np.arange(T * 4, dtype=np.float32).reshape(T, 4), open=cols[0], high=cols[1],
        low=cols[2], close=cols[3], sigma=np.full(T, sigma, np.float32),
        last_log_return=np.zeros(T, np.float32), instrument=np.zeros(T, np.int32),
        timestamps=np.arange(T).astype("datetime64[D]").astype("datetime64[ns]"),
        segments={s: seg for s in ("train", "validation", "test")},
        starts={s: starts for s in ("train", "validation", "test")},
        feature_names=("a", "b", "c", "d"), norm_mean=np.zeros(4, np.float32),
        norm_std=np.ones(4, np.float32), instrument_names=("X",), bar_seconds=86400.0,
        bars_per_year=252.0, episode_length=episode_length)


def _cfg(cost_bps=0.0, fixed_cost=0.0, fill="close", slippage_bps=0.0):
    return EnvConfig(episode_length=3, time_barrier=1, cost_bps=cost_bps, fixed_cost=fixed_cost,
                     fill=fill, slippage_bps=slippage_bps)


JIT_STEP_ENV = jax.jit(trading.step_env)
JIT_STEP = jax.jit(trading.step)
JIT_RESET_AT = jax.jit(trading.reset_at)


def _first_step(bars, action, cfg=None):
    """One step from bar 0 on the device, checked against the reference; returns its outputs."""
    cfg = cfg or _cfg()
    tables = _tables(*bars)
    params = trading.make_params(tables, cfg, "train")
    _, state = JIT_RESET_AT(0, params)
    out = JIT_STEP_ENV(KEY, state, jnp.asarray(action, jnp.int32), params)
    ref = simulate(tables, cfg, [0], np.asarray(action, np.int32)[None, None])
    assert float(out[5]["equity"]) == pytest.approx(ref["equity"][0, 0], rel=1e-6)
    assert int(out[5]["barrier"]) == ref["barrier"][0, 0]
    return out


def test_long_gap_through_stop_fills_at_open():
    # long at 100, sl = 99 (k=1, sigma 1%); bar 1 opens at 97 below the stop
    bars = ([100, 97], [100, 98], [100, 96], [100, 97.5])
    _, state, _, _, _, info = _first_step(bars, [4, 2, 0])
    assert int(info["barrier"]) == trading.STOP_LOSS and float(info["exit_price"]) == 97.0
    assert float(info["equity"]) == pytest.approx(0.97, rel=1e-6)
    assert float(state.units) == 0 and float(state.exposure) == 0


def test_short_gap_through_stop_fills_at_open():
    # short at 100, sl = 102 (k=2); bar 1 opens at 104 above the stop
    bars = ([100, 104], [100, 105], [100, 103], [100, 104])
    _, _, _, _, _, info = _first_step(bars, [0, 2, 1])
    assert int(info["barrier"]) == trading.STOP_LOSS and float(info["exit_price"]) == 104.0
    assert float(info["equity"]) == pytest.approx(0.96, rel=1e-6)


@pytest.mark.parametrize("side", ["long", "short"])
def test_stop_loss_wins_when_both_touched(side):
    # tp and sl at 1 sigma (101 / 99); bar 1 spans 98..102 and opens at 100
    bars = ([100, 100], [100, 102], [100, 98], [100, 100.5])
    action = [4, 0, 0] if side == "long" else [0, 0, 0]
    _, _, _, _, _, info = _first_step(bars, action)
    assert int(info["barrier"]) == trading.STOP_LOSS
    assert float(info["exit_price"]) == pytest.approx(99.0 if side == "long" else 101.0, rel=1e-6)
    assert float(info["equity"]) == pytest.approx(0.99, rel=1e-5)


def test_take_profit_gap_fills_at_open():
    # long at 100, tp = 103 (k=3); bar 1 opens at 105 above the take-profit
    bars = ([100, 105], [100, 106], [100, 104], [100, 105.5])
    _, _, reward, _, _, info = _first_step(bars, [4, 2, 2])
    assert int(info["barrier"]) == trading.TAKE_PROFIT and float(info["exit_price"]) == 105.0
    assert float(reward) == pytest.approx(100 * np.log(1.05), rel=1e-5)


def test_costs_and_time_barrier():
    # buy 0.01 units at 100 (cost 0.001 + 0.001); barriers at 97/103 are not touched, the time
    # barrier (1 bar) sells at the close 101 (cost 0.00101 + 0.001)
    cfg = _cfg(cost_bps=10.0, fixed_cost=0.001)
    bars = ([100, 101], [100, 102], [100, 100], [100, 101])
    _, state, reward, _, _, info = _first_step(bars, [4, 2, 2], cfg)
    cost = 0.001 + 0.001 + 0.01 * 101 * 1e-3 + 0.001
    assert float(info["cost"]) == pytest.approx(cost, rel=1e-5)
    assert int(info["barrier"]) == trading.TIME and float(info["exit_price"]) == 101.0
    assert float(info["equity"]) == pytest.approx(1.01 - cost, rel=1e-6)
    assert float(reward) == pytest.approx(100 * np.log(1.01 - cost), rel=1e-4)
    assert bool(info["traded"]) and int(state.time_in_trade) == 0


def test_next_open_fill_pays_slippage_both_ways():
    # decided at close 100; fills at bar 1's open 102 at 102 * 1.001; stop 102 * (1 - 3%) and
    # take-profit 102 * (1 + 3%) are untouched; the one-bar time barrier sells at the close 103
    # at 103 * 0.999
    cfg = _cfg(fill="next_open", slippage_bps=10.0)
    bars = ([100, 102], [100, 104], [100, 101.5], [100, 103])
    _, state, _, _, _, info = _first_step(bars, [4, 2, 2], cfg)
    units = 1 / 102
    assert float(info["equity"]) == pytest.approx(1 + units * (103 * 0.999 - 102 * 1.001),
                                                  rel=1e-6)
    assert int(info["barrier"]) == trading.TIME
    assert float(info["exit_price"]) == pytest.approx(103 * 0.999, rel=1e-6)
    assert int(info["fills"]) == 2 and float(info["turnover"]) == 2.0
    assert float(state.units) == 0


def test_next_open_barriers_are_set_from_the_fill_and_checked_on_its_bar():
    # decided at close 100; bar 1 opens at 95 and fills there: the stop (1 sigma) is 94.05, from
    # the fill, not from the decision's close; bar 1's low 94 touches it
    cfg = _cfg(fill="next_open")
    bars = ([100, 95], [100, 96], [100, 94], [100, 95.5])
    _, _, _, _, _, info = _first_step(bars, [4, 0, 0], cfg)
    assert int(info["barrier"]) == trading.STOP_LOSS
    assert float(info["exit_price"]) == pytest.approx(95 * 0.99, rel=1e-6)
    assert float(info["equity"]) == pytest.approx(0.99, rel=1e-5)
    # filled at the close instead, the same bar gaps through the stop at 99 and exits at the open
    _, _, _, _, _, info = _first_step(bars, [4, 0, 0], _cfg(fill="close"))
    assert float(info["exit_price"]) == 95.0


def test_ruin_closes_the_open_position_at_the_close():
    # long at 100 with barriers far away (sigma 50%: stop at -50, take-profit at 150, time
    # barrier 5 bars); bar 1 closes at 45: equity 0.45 < 0.5 ends the episode and sells at 45,
    # paying the cost
    cfg = dataclasses.replace(_cfg(cost_bps=10.0), time_barrier=5)
    bars = ([100, 46], [100, 47], [100, 44], [100, 45])
    tables = _tables(*bars, sigma=0.5)
    params = trading.make_params(tables, cfg, "train")
    _, state = JIT_RESET_AT(0, params)
    _, new, _, term, _, info = JIT_STEP_ENV(KEY, state, jnp.asarray([4, 2, 2], jnp.int32), params)
    ref = simulate(tables, cfg, [0], np.asarray([[[4, 2, 2]]], np.int32))
    assert bool(term) and ref["terminated"][0, 0]
    assert int(info["barrier"]) == trading.RUIN == ref["barrier"][0, 0]
    assert int(info["fills"]) == 2 and float(info["turnover"]) == 2.0
    # 0.01 units bought at 100 for 1 plus 0.001 cost, sold at 45 for 0.45 less 0.00045 cost
    assert float(info["equity"]) == pytest.approx(0.45 - 0.001 - 0.00045, rel=1e-5)
    assert float(info["equity"]) == pytest.approx(ref["equity"][0, 0], rel=1e-6)
    assert float(new.units) == 0 and float(new.exposure) == 0


def test_ruin_terminates_and_auto_reset_is_fresh():
    # long at 100; bar 1 gaps to 40, through the stop at 97: equity 0.4 < ruin floor 0.5
    params = trading.make_params(_tables([100, 40], [100, 41], [100, 39], [100, 40]), _cfg(),
                                 "train")
    _, state = JIT_RESET_AT(0, params)
    action = jnp.array([4, 2, 2], jnp.int32)
    obs, new, reward, term, trunc, info = JIT_STEP(KEY, state, action, params)
    assert bool(term) and not bool(trunc)
    assert float(info["equity"]) == pytest.approx(0.4, rel=1e-6)
    assert float(reward) == pytest.approx(100 * np.log(0.4), rel=1e-5)
    # the returned state is a fresh episode at a valid start
    assert int(new.step) == 0 and float(new.equity) == 1 and float(new.units) == 0
    assert int(new.bar) in set(params.starts.tolist())
    np.testing.assert_array_equal(obs[:4], params.features[int(new.bar)])
    np.testing.assert_array_equal(obs[4:], [0, 0, 0, 0, 0, 0])
    # without auto-reset the ruined state is kept
    _, kept, *_ = JIT_STEP_ENV(KEY, state, action, params)
    assert int(kept.step) == 1 and int(kept.bar) == 1
    assert float(kept.equity) == pytest.approx(0.4, rel=1e-6)


def test_truncation_at_episode_length():
    closes = [100, 101, 102, 101, 100, 99, 100, 101]
    params = trading.make_params(_tables(closes, [c + 1 for c in closes], [c - 1 for c in closes],
                                         closes), _cfg(), "train")
    obs, state = JIT_RESET_AT(1, params)
    key = jax.random.key(4)
    for k in range(3):
        key, sub = jax.random.split(key)
        obs, state, reward, term, trunc, info = JIT_STEP(sub, state, jnp.array([3, 2, 2]), params)
        assert not bool(term)
        assert bool(trunc) == (k == 2)
        if k < 2:
            assert int(state.bar) == 2 + k and int(state.step) == k + 1
            # half long each step, closed by the one-bar time barrier at the next close
            assert bool(info["traded"]) and int(info["barrier"]) == trading.TIME
            assert float(state.exposure) == 0 and int(state.time_in_trade) == 0
    # auto-reset after truncation: a fresh flat episode whose observation matches its bar
    assert int(state.step) == 0 and float(state.equity) == 1.0 and float(state.units) == 0
    np.testing.assert_array_equal(obs[:4], params.features[int(state.bar)])
    chex.assert_shape(obs, (trading.obs_dim(params),))


def test_shapes_dtypes_and_params(us_tables):
    cfg = EnvConfig()
    params = trading.make_params(us_tables, cfg, "train")
    assert trading.obs_dim(params) == us_tables.features.shape[1] + 6 == 40
    assert cfg.branch_sizes == param_branch_sizes(params) == (5, 3, 3)
    assert EnvConfig(take_profit=()).branch_sizes == (5, 3)
    # abstract evaluation: shapes and dtypes without compiling
    obs, state = jax.eval_shape(trading.reset, KEY, params)
    chex.assert_shape(obs, (40,))
    assert obs.dtype == jnp.float32
    for f in ("equity", "cash", "units", "exposure", "entry_price", "tp_price", "sl_price"):
        assert getattr(state, f).shape == () and getattr(state, f).dtype == jnp.float32, f
    for f in ("bar", "step", "time_in_trade"):
        assert getattr(state, f).shape == () and getattr(state, f).dtype == jnp.int32, f
    out = jax.eval_shape(trading.step, KEY, state, jnp.zeros(3, jnp.int32), params)
    obs2, state2, reward, term, trunc, info = out
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state2) == \
        jax.tree.map(lambda x: (x.shape, x.dtype), state)
    assert obs2.shape == (40,) and reward.shape == () and reward.dtype == jnp.float32
    assert term.dtype == trunc.dtype == info["traded"].dtype == jnp.bool_
    assert info["barrier"].dtype == info["fills"].dtype == jnp.int32
    assert {k: v.dtype for k, v in info.items() if k not in ("traded", "barrier", "fills")} == \
        {k: jnp.float32 for k in ("equity", "cost", "fill_price", "exit_price", "turnover")}
    with pytest.raises(ConfigError, match="unknown split 'dev'"):
        trading.make_params(us_tables, cfg, "dev")
    # a longer horizon than the tables' (walking a whole split) is allowed; starts stay the
    # tables' starts (the first num_starts of them, the rest padding)
    long = trading.make_params(us_tables, dataclasses.replace(cfg, episode_length=400), "test")
    assert long.episode_length == 400
    n = int(long.num_starts)
    np.testing.assert_array_equal(long.starts[:n], us_tables.starts["test"])


def test_encode_decode_rebuild_observations():
    closes = [100, 101, 102, 101, 100, 99, 100, 101]
    params = trading.make_params(_tables(closes, [c + 1 for c in closes], [c - 1 for c in closes],
                                         closes), _cfg(), "train")
    _, state = JIT_RESET_AT(2, params)
    obs, state, *_ = JIT_STEP_ENV(KEY, state, jnp.array([4, 1, 1]), params)
    enc = trading.encode(obs, state)
    back = trading.decode(jax.tree.map(lambda x: jnp.stack([x, x]), enc), params)
    chex.assert_shape(back, (2, trading.obs_dim(params)))
    np.testing.assert_array_equal(back[1], obs)
    np.testing.assert_array_equal(trading.obs_from(state.bar, obs[-trading.P:], params), obs)


def test_random_rollout_1024_episodes(us_tables):
    cfg = EnvConfig()
    params = trading.make_params(us_tables, cfg, "train")
    policy = trading.random_policy(cfg.branch_sizes)
    assert trading.random_policy(list(cfg.branch_sizes)) is policy
    out = trading.rollout(jax.random.key(1), params, policy, 1024, 100)
    for k in ("reward", "equity", "terminated", "truncated"):
        chex.assert_shape(out[k], (100, 1024))
    chex.assert_type([out["reward"], out["equity"]], jnp.float32)
    assert bool(jnp.all(jnp.isfinite(out["equity"]))) and bool(jnp.all(out["equity"] > 0))
    assert bool(jnp.all(jnp.isfinite(out["reward"])))
    # every episode truncates at step 100 unless ruined first
    done_last = out["truncated"][-1] | out["terminated"].any(0)
    assert bool(jnp.all(done_last))
    # random trading pays costs: mean log growth is negative
    assert float(out["reward"].mean()) < 0


@pytest.mark.parametrize("fill", ["next_open", "close"])
def test_always_long_walk_counts_every_exit(us_tables, fill):
    """An always-long policy walked over the test split: its trades and turnover count the
    take-profit, stop-loss and time-barrier exits and the re-entries after them, and equal the
    float64 reference's."""
    cfg = EnvConfig(fill=fill)
    long_action = np.asarray([cfg.exposures.index(1.0), 1, 1], np.int32)
    params, starts, lengths = validate.evaluation_params(us_tables, cfg, "test")
    steps = int(lengths.max())

    def always_long(key, obs, state):
        return jnp.broadcast_to(jnp.asarray(long_action), (obs.shape[0], long_action.size))

    traj = jax.jit(lambda p: validate.policy_rollout(p, jnp.asarray(starts), steps, always_long,
                                                     KEY, jnp.asarray(lengths)))(params)
    paths = validate.equity_paths(traj)
    got = trading_metrics(paths["equity"], paths["exposure"], paths["trades"], 252.0,
                          turnover=paths["turnover"])

    w = len(starts)
    eq = np.full((w, steps + 1), np.nan)
    fills, turnover = np.zeros((w, steps)), np.zeros((w, steps))
    for i in range(w):
        n = int(lengths[i])
        ref = simulate(us_tables, dataclasses.replace(cfg, episode_length=n), starts[i:i + 1],
                       np.broadcast_to(long_action, (1, n, 3)))
        alive = np.cumsum(ref["terminated"][:, 0]) - ref["terminated"][:, 0] == 0
        m = int(alive.sum())
        eq[i, 0], eq[i, 1:m + 1] = 1.0, ref["equity"][:m, 0]
        fills[i, :m], turnover[i, :m] = ref["fills"][:m, 0], ref["turnover"][:m, 0]
    bars = int(np.isfinite(eq[:, 1:]).sum())
    assert got["bars"] == bars
    assert got["trades"] == int(fills.sum())
    np.testing.assert_allclose(got["turnover"], turnover.sum() / bars, rtol=1e-6)
    # many more trades than one entry per walk: every exit and re-entry counts
    assert got["trades"] > 10 * w
    # the chosen exposure alone never changes after the first bar: its turnover would be 1 / L
    assert got["turnover"] > 10 * w / bars
