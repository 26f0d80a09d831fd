"""The trading environment as pure JAX functions (gymnax 1.x style, one episode; vmap for N).

The rules are those of docs/environment.md, which is the specification; ``tests/reference_env.py``
simulates the same rules in float64 NumPy and the tests require equal equity paths.

Timing at global bar t: observe feature row t and the portfolio marked at close[t]; the action
fills at open[t+1] (``env.fill: next_open``) or at close[t] (``close``), every fill price moved
against the trade by ``env.slippage_bps``; then bar t+1's Open/High/Low are checked against the
barriers, the position is marked at close[t+1] and the episode moves to bar t+1. Money (equity,
cash, units) is float32 on device; initial equity is 1.

Action layout [B] int32: exposure index; then the take-profit index when ``env.take_profit`` is
non-empty; then the stop-loss index when ``env.stop_loss`` is non-empty.

Two guards the spec leaves open, shared with the reference simulator:
- the side of a position (for barrier checks) is the sign of its nominal ``exposure``;
- the reward and ``log(equity)`` observation floor equity at ``EQUITY_FLOOR`` (1e-6) so a
  ruinous gap that wipes out equity gives a large finite penalty instead of NaN.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from foxhunt_jax.config import EnvConfig
from foxhunt_jax.data.features import MarketTables, SPLITS
from foxhunt_jax.errors import ConfigError

PORTFOLIO_DIM = P = 6  # portfolio features appended to the market features
EQUITY_FLOOR = 1e-6
OBS_CLIP = 10.0
NONE, TAKE_PROFIT, STOP_LOSS, TIME, RUIN = 0, 1, 2, 3, 4  # info["barrier"] codes


@struct.dataclass
class EnvParams:
    """Device arrays of one split plus the env settings (shared by all vmapped episodes).

    features [T, F] f32; open, high, low, close, sigma [T] f32; starts [S] int32, of which the
    first ``num_starts`` (int32 []) are the episodes' start bars; exposures [n0] f32;
    take_profit [n1] f32 / stop_loss [n2] f32 (empty when that barrier is off); cost_rate,
    fixed_cost, ruin_floor, reward_scale, slippage_rate: f32 scalars;
    ``fill_next_open``: the chosen trade fills at the next bar's open (else at this close).
    """

    features: jax.Array
    open: jax.Array
    high: jax.Array
    low: jax.Array
    close: jax.Array
    sigma: jax.Array
    starts: jax.Array
    num_starts: jax.Array
    exposures: jax.Array
    take_profit: jax.Array
    stop_loss: jax.Array
    cost_rate: jax.Array
    fixed_cost: jax.Array
    ruin_floor: jax.Array
    reward_scale: jax.Array
    slippage_rate: jax.Array
    episode_length: int = struct.field(pytree_node=False, default=100)
    time_barrier: int = struct.field(pytree_node=False, default=20)
    has_take_profit: bool = struct.field(pytree_node=False, default=True)
    has_stop_loss: bool = struct.field(pytree_node=False, default=True)
    fill_next_open: bool = struct.field(pytree_node=False, default=True)


@struct.dataclass
class EnvState:
    """One episode. bar/step/time_in_trade int32 scalars; the rest float32 scalars.

    A flat position has units = exposure = entry_price = tp_price = sl_price = 0.
    """

    bar: jax.Array
    step: jax.Array
    equity: jax.Array
    cash: jax.Array
    units: jax.Array
    exposure: jax.Array
    entry_price: jax.Array
    tp_price: jax.Array
    sl_price: jax.Array
    time_in_trade: jax.Array


def padded_size(n: int) -> int:
    """The length a table of ``n`` rows (or ``n`` start bars) is padded to in :class:`EnvParams`:
    the next power of two. Markets of nearby sizes (another window, a walk-forward's folds)
    then give the programs the same argument shapes, so they share compiled programs."""
    return 1 << max(int(n) - 1, 0).bit_length()


def _pad_rows(x, rows: int) -> np.ndarray:
    """``x`` with its last row repeated up to ``rows`` rows: a read past the last bar sees what
    JAX's clamped index would have read without the padding."""
    x = np.asarray(x)
    return np.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1), mode="edge") \
        if x.shape[0] else x


def make_params(tables: MarketTables, env_cfg: EnvConfig, split: str,
                starts: np.ndarray | None = None, min_rows: int = 0) -> EnvParams:
    """Device params of ``split`` ("train", "validation" or "test").

    ``starts`` (default: the tables' valid starts of the split, valid for
    ``tables.episode_length`` steps) are the bars :func:`reset` draws from; with a longer
    ``env_cfg.episode_length`` (walking a whole split), start episodes with :func:`reset_at` at
    bars that leave room for them instead. The tables are padded to :func:`padded_size` rows
    (of at least ``min_rows``: ``data.min_table_rows``) and the starts to as many (the padding
    is never drawn or stepped into: a split's count of starts then changes no shape);
    ``num_starts`` counts the real starts.
    """
    if split not in tables.starts:
        raise ConfigError(f"unknown split '{split}' (known: {', '.join(SPLITS)})")
    starts = np.asarray(tables.starts[split] if starts is None else starts, np.int32)
    rows = padded_size(max(len(tables.close), int(min_rows)))
    f32 = lambda x: jnp.asarray(np.asarray(x, np.float32))  # noqa: E731
    table = lambda x: f32(_pad_rows(np.asarray(x, np.float32), rows))  # noqa: E731
    return EnvParams(
        features=table(tables.features), open=table(tables.open), high=table(tables.high),
        low=table(tables.low), close=table(tables.close), sigma=table(tables.sigma),
        starts=jnp.asarray(_pad_rows(starts, max(rows, padded_size(len(starts))))),
        num_starts=jnp.asarray(len(starts), jnp.int32),
        exposures=f32(env_cfg.exposures), take_profit=f32(env_cfg.take_profit),
        stop_loss=f32(env_cfg.stop_loss), cost_rate=f32(env_cfg.cost_bps / 1e4),
        fixed_cost=f32(env_cfg.fixed_cost), ruin_floor=f32(env_cfg.ruin_floor),
        reward_scale=f32(env_cfg.reward_scale), slippage_rate=f32(env_cfg.slippage_bps / 1e4),
        episode_length=int(env_cfg.episode_length),
        time_barrier=int(env_cfg.time_barrier), has_take_profit=bool(env_cfg.take_profit),
        has_stop_loss=bool(env_cfg.stop_loss), fill_next_open=env_cfg.fill == "next_open")


def obs_dim(params: EnvParams) -> int:
    return int(params.features.shape[1]) + P


# ---------------------------------------------------------------------------------------------
# Observation


def portfolio_features(state: EnvState, params: EnvParams) -> tuple[jax.Array, ...]:
    """The P portfolio numbers of :func:`portfolio_obs` as a tuple of arrays shaped like the
    state's fields: [exposure, unrealized / equity, time_in_trade / H, tp dist, sl dist,
    log equity].

    Elementwise over any batch shape of ``state``; the ``params`` tables are only indexed
    (``params.close[bar]``), so the fused rollout kernel calls this same function with Pallas
    refs in place of the tables.
    """
    c = params.close[state.bar]
    s = params.sigma[state.bar]
    open_ = state.units != 0
    eq = jnp.maximum(state.equity, EQUITY_FLOOR)
    unreal = jnp.where(open_, state.units * (c - state.entry_price) / eq, 0.0)

    def dist(level):
        # a disabled level is 0 or +inf, a cleared one 0: both give 0
        ok = open_ & (level > 0) & (level < jnp.inf)
        # log1p of the (exact, nearby-float) difference keeps precision when level ~ c
        d = jnp.log1p((jnp.where(ok, level, c) - c) / c) / s
        return jnp.where(ok, jnp.clip(d, -OBS_CLIP, OBS_CLIP), 0.0)

    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return (f32(state.exposure), f32(unreal),
            state.time_in_trade.astype(jnp.float32) / params.time_barrier,
            f32(dist(state.tp_price)), f32(dist(state.sl_price)), f32(jnp.log(eq)))


def portfolio_obs(state: EnvState, params: EnvParams) -> jax.Array:
    """[P] = [exposure, unrealized / equity, time_in_trade / H, tp dist, sl dist, log equity]."""
    return jnp.stack(portfolio_features(state, params), axis=-1)


def obs_from(bar: jax.Array, portfolio: jax.Array, params: EnvParams) -> jax.Array:
    """(bar int32 [], portfolio [P]) -> observation [D]; the replay buffer's compact form."""
    return jnp.concatenate([params.features[bar], portfolio])


def observation(state: EnvState, params: EnvParams) -> jax.Array:
    """[D] = concat(features[bar], portfolio_obs)."""
    return obs_from(state.bar, portfolio_obs(state, params), params)


def encode(obs: jax.Array, state: EnvState) -> dict:
    """Compact replay form of an observation: {"bar": int32 [], "portfolio": [P]}."""
    return {"bar": state.bar, "portfolio": obs[-P:]}


def decode(enc: dict, params: EnvParams) -> jax.Array:
    """Batched inverse of :func:`encode`: {"bar": [M], "portfolio": [M, P]} -> [M, D]."""
    return jax.vmap(obs_from, in_axes=(0, 0, None))(enc["bar"], enc["portfolio"], params)


# ---------------------------------------------------------------------------------------------
# Reset and step


def fresh_state(bar: jax.Array) -> EnvState:
    """A fresh flat episode at global bar ``bar`` (any batch shape; every field shaped like it).

    The one definition of a starting state: :func:`reset_at` and the fused rollout kernel's
    auto-reset both build it here."""
    bar = jnp.asarray(bar, jnp.int32)
    zero = jnp.zeros(bar.shape, jnp.float32)
    one = jnp.ones(bar.shape, jnp.float32)
    izero = jnp.zeros(bar.shape, jnp.int32)
    return EnvState(bar=bar, step=izero, equity=one, cash=one, units=zero, exposure=zero,
                    entry_price=zero, tp_price=zero, sl_price=zero, time_in_trade=izero)


def reset_at(bar: jax.Array, params: EnvParams) -> tuple[jax.Array, EnvState]:
    """A fresh flat episode at global bar ``bar`` -> (obs [D], state)."""
    state = fresh_state(bar)
    return observation(state, params), state


def start_bar(key: jax.Array, params: EnvParams) -> jax.Array:
    """A uniformly drawn valid start bar of the split (int32 [])."""
    i = jax.random.randint(key, (), 0, params.num_starts)
    return params.starts[i]


def reset(key: jax.Array, params: EnvParams) -> tuple[jax.Array, EnvState]:
    """A fresh episode at a uniformly drawn valid start of the split."""
    return reset_at(start_bar(key, params), params)


def _barrier_levels(c, s, e_new, a_tp, a_sl, params: EnvParams):
    """Take-profit and stop-loss prices of a new position of exposure ``e_new`` entered at the
    market price c (the fill's price before slippage).

    ``c +- c * (k * s)`` equals the spec's ``c * (1 +- k * s)``; the rounding error of the small
    move hardly shows in the sum, which rounds once, so the float32 level is almost always the
    correctly rounded value the float64 reference stores.
    """
    long = e_new > 0
    inf = jnp.float32(jnp.inf)
    if params.has_take_profit:
        move = c * (params.take_profit[a_tp] * s)
        tp = jnp.where(long, c + move, c - move)
    else:
        tp = jnp.where(long, inf, 0.0)
    if params.has_stop_loss:
        move = c * (params.stop_loss[a_sl] * s)
        sl = jnp.where(long, c - move, c + move)
    else:
        sl = jnp.where(long, 0.0, inf)
    return tp.astype(jnp.float32), sl.astype(jnp.float32)


def _executed(price, direction, params: EnvParams):
    """The price a fill of ``direction`` (+1 buy, -1 sell, 0 none) executes at: ``price`` moved
    against the trade by the slippage."""
    return price * (1.0 + params.slippage_rate * direction)


# what a step from bar t reads of the tables before its action: close[t], sigma[t], then bar
# t+1's open, high, low and close (:func:`market_row`)
MARKET_ROW = ("close", "sigma", "next_open", "next_high", "next_low", "next_close")


def market_row(bar: jax.Array, params: EnvParams) -> tuple[jax.Array, ...]:
    """The prices a step from ``bar`` reads, none of which depends on the action, in the order
    of :data:`MARKET_ROW`."""
    n = bar + 1
    return (params.close[bar], params.sigma[bar], params.open[n], params.high[n], params.low[n],
            params.close[n])


def advance(state: EnvState, actions: tuple, params: EnvParams, row: tuple | None = None):
    """One step from bar t, no auto-reset, elementwise over any batch shape of ``state``.

    ``actions``: one int32 array per branch, shaped like the state's fields; ``row``: the
    step's :func:`market_row` if already read (the fused rollout kernel reads it beside the
    forward pass), else read here.
    Returns (state, reward, terminated, truncated, info) with info: equity, cost, traded (bool:
    the chosen exposure differs from the held one), fill_price (the chosen trade's executed
    price, else 0), exit_price (executed price of a barrier or ruin exit, else 0), barrier
    (int32 code), fills (int32: the chosen trade plus an exit, 0..2) and turnover (the nominal
    exposure those fills moved, a fraction of equity).

    This is the single definition of the step's rules: :func:`step_env` calls it for one episode
    and the fused rollout kernel (``pallas_kernels/rollout.py``) for a block of episodes, with
    Pallas refs in place of the ``params`` tables (only indexing touches them).
    """
    n = state.bar + 1
    c, s, o, h, lo, cn = market_row(state.bar, params) if row is None else row
    a_tp = actions[1] if params.has_take_profit else 0
    a_sl = actions[1 + int(params.has_take_profit)] if params.has_stop_loss else 0
    e, e_new = state.exposure, params.exposures[actions[0]]

    # 1. the chosen trade, at open[t+1] or close[t]
    equity_t = state.cash + state.units * c
    px = o if params.fill_next_open else c
    traded = e_new != e
    units_new = e_new * (state.cash + state.units * px) / px
    dunits = units_new - state.units
    px_exec = _executed(px, jnp.sign(dunits), params)
    trade_cost = jnp.where(traded, jnp.abs(dunits) * px_exec * params.cost_rate
                           + params.fixed_cost, 0.0)
    cash = jnp.where(traded, state.cash - dunits * px_exec - trade_cost, state.cash)
    units = jnp.where(traded, units_new, state.units)
    exposure = jnp.where(traded, e_new, e)
    tp_new, sl_new = _barrier_levels(px, s, e_new, a_tp, a_sl, params)
    opened = traded & (e_new != 0)
    flat_now = traded & (e_new == 0)
    tp = jnp.where(opened, tp_new, jnp.where(flat_now, 0.0, state.tp_price))
    sl = jnp.where(opened, sl_new, jnp.where(flat_now, 0.0, state.sl_price))
    entry = jnp.where(opened, px, jnp.where(flat_now, 0.0, state.entry_price))
    tit = jnp.where(traded, 0, state.time_in_trade)

    # 2. barriers on bar t+1
    holding = units != 0
    long = exposure > 0
    sl_hit = holding & jnp.where(long, lo <= sl, h >= sl)
    tp_hit = holding & ~sl_hit & jnp.where(long, h >= tp, lo <= tp)
    time_hit = holding & ~sl_hit & ~tp_hit & (tit + 1 >= params.time_barrier)
    sl_px = jnp.where(long, jnp.minimum(o, sl), jnp.maximum(o, sl))
    tp_px = jnp.where(long, jnp.maximum(o, tp), jnp.minimum(o, tp))
    exited = sl_hit | tp_hit | time_hit
    exit_market = jnp.where(sl_hit, sl_px, jnp.where(tp_hit, tp_px, cn))
    exit_price = jnp.where(exited, _executed(exit_market, -jnp.sign(units), params), 0.0)
    barrier = jnp.where(sl_hit, STOP_LOSS, jnp.where(tp_hit, TAKE_PROFIT,
                                                     jnp.where(time_hit, TIME, NONE)))
    exit_cost = jnp.where(exited, jnp.abs(units) * exit_price * params.cost_rate
                          + params.fixed_cost, 0.0)
    cash = jnp.where(exited, cash + units * exit_price - exit_cost, cash)
    turnover = jnp.where(traded, jnp.abs(e_new - e), 0.0) + jnp.where(exited, jnp.abs(exposure),
                                                                       0.0)
    units = jnp.where(exited, 0.0, units)
    tit = jnp.where(exited, 0, jnp.where(holding, tit + 1, tit))

    # 3. mark at close[t+1]; 4. ruin closes a position still open at that close
    terminated = cash + units * cn < params.ruin_floor
    ruined = terminated & (units != 0)
    ruin_price = _executed(cn, -jnp.sign(units), params)
    ruin_cost = jnp.where(ruined, jnp.abs(units) * ruin_price * params.cost_rate
                          + params.fixed_cost, 0.0)
    cash = jnp.where(ruined, cash + units * ruin_price - ruin_cost, cash)
    turnover = turnover + jnp.where(ruined, jnp.abs(exposure), 0.0)
    exit_price = jnp.where(ruined, ruin_price, exit_price)
    barrier = jnp.where(ruined, RUIN, barrier)
    closed = exited | ruined
    units = jnp.where(ruined, 0.0, units)
    exposure = jnp.where(closed, 0.0, exposure)
    tp = jnp.where(closed, 0.0, tp)
    sl = jnp.where(closed, 0.0, sl)
    entry = jnp.where(closed, 0.0, entry)
    tit = jnp.where(ruined, 0, tit)
    equity = cash + units * cn

    # 5. reward and truncation
    reward = params.reward_scale * jnp.log(jnp.maximum(equity, EQUITY_FLOOR)
                                           / jnp.maximum(equity_t, EQUITY_FLOOR))
    truncated = (state.step + 1 >= params.episode_length) & ~terminated

    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    new_state = EnvState(bar=n.astype(jnp.int32), step=(state.step + 1).astype(jnp.int32),
                         equity=f32(equity), cash=f32(cash), units=f32(units),
                         exposure=f32(exposure), entry_price=f32(entry), tp_price=f32(tp),
                         sl_price=f32(sl), time_in_trade=tit.astype(jnp.int32))
    info = {"equity": f32(equity), "cost": f32(trade_cost + exit_cost + ruin_cost),
            "traded": traded, "fill_price": f32(jnp.where(traded, px_exec, 0.0)),
            "exit_price": f32(exit_price), "barrier": barrier.astype(jnp.int32),
            "fills": traded.astype(jnp.int32) + closed.astype(jnp.int32),
            "turnover": f32(turnover)}
    return new_state, f32(reward), terminated, truncated, info


def step_env(key: jax.Array, state: EnvState, action: jax.Array, params: EnvParams):
    """One step of one episode from bar t, no auto-reset (:func:`advance`).

    action [B] int32 -> (obs [D], state, reward [], terminated [], truncated [], info).
    """
    del key  # the step is deterministic
    actions = tuple(action[..., i] for i in range(action.shape[-1]))
    new_state, reward, terminated, truncated, info = advance(state, actions, params)
    return observation(new_state, params), new_state, reward, terminated, truncated, info


def step(key: jax.Array, state: EnvState, action: jax.Array, params: EnvParams):
    """:func:`step_env`, then a fresh :func:`reset` (new random start) when the episode ended.

    reward, terminated, truncated and info are those of the step that ended the episode.
    """
    # step_env is deterministic, so the whole key goes to the reset (one fewer PRNG call)
    obs, new_state, reward, terminated, truncated, info = step_env(key, state, action, params)
    obs_re, state_re = reset(key, params)
    done = terminated | truncated
    new_state = jax.tree.map(lambda a, b: jnp.where(done, a, b), state_re, new_state)
    obs = jnp.where(done, obs_re, obs)
    return obs, new_state, reward, terminated, truncated, info


# ---------------------------------------------------------------------------------------------
# Batched rollouts


def random_policy(sizes) -> Callable:
    """policy(key, obs [N, D]) -> actions [N, B] int32, uniform in every branch.

    Cached per ``sizes`` so that the same function object (and jit cache entry) is reused.
    """
    return _random_policy(tuple(int(n) for n in sizes))


@functools.lru_cache(maxsize=None)
def _random_policy(sizes: tuple[int, ...]) -> Callable:
    high = np.asarray(sizes, np.int32)

    def policy(key, obs):
        return jax.random.randint(key, (obs.shape[0], high.shape[0]), 0, high, dtype=jnp.int32)

    return policy


@functools.partial(jax.jit, static_argnames=("policy_fn", "num_episodes", "num_steps"))
def rollout(key: jax.Array, params: EnvParams, policy_fn: Callable, num_episodes: int,
            num_steps: int) -> dict:
    """N episodes (vmap) for L steps (scan) with auto-reset.

    Returns {"reward", "equity", "terminated", "truncated"}, each [L, N].
    """
    key_reset, key_run = jax.random.split(key)
    obs, state = jax.vmap(reset, in_axes=(0, None))(jax.random.split(key_reset, num_episodes),
                                                     params)
    step_v = jax.vmap(step, in_axes=(0, 0, 0, None))

    def body(carry, k):
        obs, state = carry
        keys = jax.random.split(k, num_episodes + 1)
        actions = policy_fn(keys[0], obs)
        obs, state, reward, term, trunc, info = step_v(keys[1:], state, actions, params)
        out = {"reward": reward, "equity": info["equity"], "terminated": term,
               "truncated": trunc}
        return (obs, state), out

    _, out = jax.lax.scan(body, (obs, state), jax.random.split(key_run, num_steps))
    return out


__all__ = [
    "EnvParams", "EnvState", "make_params", "reset", "reset_at", "fresh_state", "start_bar",
    "step_env", "advance", "market_row", "MARKET_ROW", "step", "observation", "portfolio_obs",
    "portfolio_features", "obs_from", "obs_dim",
    "encode", "decode", "rollout", "random_policy", "P", "PORTFOLIO_DIM", "NONE", "TAKE_PROFIT",
    "STOP_LOSS", "TIME", "RUIN",
]
