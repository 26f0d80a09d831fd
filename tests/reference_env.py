"""Independent float64 NumPy simulator of docs/environment.md, plus market helpers for tests.

Written from the specification, not from ``foxhunt_jax/env/trading.py``: plain Python loops over
episodes and steps, Python floats (float64) for money. The only float32 step is the one the spec
asks for: barrier levels are rounded to float32 when they are set. Prices and sigma come from the
same float32 tables the device uses (read as float64).

Shared guards (documented in trading.py): a position's side is the sign of its nominal exposure;
the reward floors equity at 1e-6 before the log.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from foxhunt_jax.config import EnvConfig
from foxhunt_jax.data.market import (
    Instrument,
    MarketData,
    median_bar_seconds,
    observed_bars_per_year,
)

FLOOR = 1e-6


def _f32(x: float) -> float:
    return float(np.float32(x))


class _Episode:
    """Portfolio of one episode. tp/sl are None when the barrier is off or the book is flat."""

    def __init__(self, bar: int):
        self.bar, self.k = bar, 0
        self.cash, self.units, self.exposure, self.entry = 1.0, 0.0, 0.0, 0.0
        self.tp: float | None = None
        self.sl: float | None = None
        self.held = 0  # time in trade

    def flatten(self):
        self.units, self.exposure, self.entry, self.held = 0.0, 0.0, 0.0, 0
        self.tp = self.sl = None


def _portfolio(ep: _Episode, c: float, s: float, equity: float, horizon: int) -> list[float]:
    def dist(level):
        if ep.units == 0 or level is None or level <= 0:
            return 0.0
        return min(max(math.log(level / c) / s, -10.0), 10.0)

    unreal = ep.units * (c - ep.entry) / max(equity, FLOOR) if ep.units != 0 else 0.0
    return [ep.exposure, unreal, ep.held / horizon, dist(ep.tp), dist(ep.sl),
            math.log(max(equity, FLOOR))]


def simulate(tables, cfg: EnvConfig, starts, actions) -> dict:
    """Runs episodes from ``starts`` [N] with ``actions`` [N, L, B] (no auto-reset).

    Returns float64/int/bool arrays [L, N]: equity, reward, cost, traded, exit_price, barrier,
    terminated, truncated, fills (every fill of the step: the chosen trade, a barrier or ruin
    exit) and turnover (the exposure those fills moved); and portfolio [L, N, 6], the portfolio
    observation before each step.
    """
    O, H, Lo, C, S = (np.asarray(a, np.float64) for a in
                      (tables.open, tables.high, tables.low, tables.close, tables.sigma))
    actions = np.asarray(actions)
    n_ep, n_steps = actions.shape[0], actions.shape[1]
    rate, slip = cfg.cost_bps / 1e4, cfg.slippage_bps / 1e4
    has_tp, has_sl = len(cfg.take_profit) > 0, len(cfg.stop_loss) > 0
    names = ("equity", "reward", "cost", "exit_price", "turnover")
    out = {k: np.zeros((n_steps, n_ep)) for k in names}
    out.update(barrier=np.zeros((n_steps, n_ep), np.int64),
               fills=np.zeros((n_steps, n_ep), np.int64),
               traded=np.zeros((n_steps, n_ep), bool), terminated=np.zeros((n_steps, n_ep), bool),
               truncated=np.zeros((n_steps, n_ep), bool), portfolio=np.zeros((n_steps, n_ep, 6)))

    def close_out(ep, market):
        """Sells a long / buys back a short at ``market`` moved against it by the slippage;
        returns (executed price, fee)."""
        executed = market * (1 - slip) if ep.units > 0 else market * (1 + slip)
        fee = abs(ep.units) * executed * rate + cfg.fixed_cost
        ep.cash += ep.units * executed - fee
        return executed, fee

    for i in range(n_ep):
        ep = _Episode(int(starts[i]))
        for k in range(n_steps):
            t = ep.bar
            c, s = C[t], S[t]
            o, h, lo, cl = O[t + 1], H[t + 1], Lo[t + 1], C[t + 1]
            act = [int(a) for a in actions[i, k]]
            eq0 = ep.cash + ep.units * c
            out["portfolio"][k, i] = _portfolio(ep, c, s, eq0, cfg.time_barrier)
            target = float(cfg.exposures[act[0]])
            cost, fills, turnover = 0.0, 0, 0.0
            traded = target != ep.exposure
            if traded:
                px = o if cfg.fill == "next_open" else c
                units = target * (ep.cash + ep.units * px) / px
                d = units - ep.units
                executed = px * (1 + slip) if d > 0 else px * (1 - slip) if d < 0 else px
                fee = abs(d) * executed * rate + cfg.fixed_cost
                ep.cash -= d * executed + fee
                cost += fee
                fills, turnover = 1, abs(target - ep.exposure)
                if target == 0:
                    ep.flatten()
                else:
                    ep.units, ep.exposure, ep.entry, ep.held = units, target, px, 0
                    sign = 1.0 if target > 0 else -1.0
                    ep.tp = _f32(px * (1 + sign * cfg.take_profit[act[1]] * s)) if has_tp else None
                    j = 1 + int(has_tp)
                    ep.sl = _f32(px * (1 - sign * cfg.stop_loss[act[j]] * s)) if has_sl else None
            code, exit_px = 0, 0.0
            if ep.units != 0:
                is_long = ep.exposure > 0
                if ep.sl is not None and (lo <= ep.sl if is_long else h >= ep.sl):
                    code, market = 2, (min(o, ep.sl) if is_long else max(o, ep.sl))
                elif ep.tp is not None and (h >= ep.tp if is_long else lo <= ep.tp):
                    code, market = 1, (max(o, ep.tp) if is_long else min(o, ep.tp))
                elif ep.held + 1 >= cfg.time_barrier:
                    code, market = 3, cl
                if code:
                    exit_px, fee = close_out(ep, market)
                    cost += fee
                    fills, turnover = fills + 1, turnover + abs(ep.exposure)
                    ep.flatten()
                else:
                    ep.held += 1
            term = ep.cash + ep.units * cl < cfg.ruin_floor
            if term and ep.units != 0:  # ruin closes the position still open at the close
                code = 4
                exit_px, fee = close_out(ep, cl)
                cost += fee
                fills, turnover = fills + 1, turnover + abs(ep.exposure)
                ep.flatten()
            eq1 = ep.cash + ep.units * cl
            out["equity"][k, i] = eq1
            out["reward"][k, i] = cfg.reward_scale * math.log(max(eq1, FLOOR) / max(eq0, FLOOR))
            out["cost"][k, i] = cost
            out["traded"][k, i] = traded
            out["exit_price"][k, i] = exit_px
            out["barrier"][k, i] = code
            out["fills"][k, i] = fills
            out["turnover"][k, i] = turnover
            out["terminated"][k, i] = term
            out["truncated"][k, i] = (k + 1 >= cfg.episode_length) and not term
            ep.bar, ep.k = t + 1, k + 1
    return out


# ---------------------------------------------------------------------------------------------
# Market helpers for tests


def random_market(seed: int, lengths=(400, 300), vol: float = 0.01, zero_volume=False,
                  freq: str = "D") -> MarketData:
    """Geometric random-walk bars with consistent OHLC (H >= max(O, C), L <= min(O, C))."""
    rng = np.random.default_rng(seed)
    instruments = []
    for j, n in enumerate(lengths):
        r = rng.normal(0.0002, vol, n)
        close = 50.0 * (1 + j) * np.exp(np.cumsum(r))
        prev = np.concatenate([[close[0] * np.exp(-r[0])], close[:-1]])
        open_ = prev * np.exp(rng.normal(0, vol / 4, n))
        high = np.maximum(open_, close) * np.exp(np.abs(rng.normal(0, vol / 2, n)))
        low = np.minimum(open_, close) * np.exp(-np.abs(rng.normal(0, vol / 2, n)))
        volume = np.zeros(n) if zero_volume else rng.lognormal(12, 0.5, n)
        stamps = pd.date_range("2001-01-01", periods=n, freq=freq).values.astype("datetime64[ns]")
        instruments.append(Instrument(f"R{j}", f"random:{seed}", stamps, open_, high, low, close,
                                      volume))
    ins = tuple(instruments)
    return MarketData(ins, median_bar_seconds(ins), observed_bars_per_year(ins))


def replace_bars(market: MarketData, index: int, first: int, rng: np.random.Generator,
                 last: int | None = None) -> MarketData:
    """A copy of ``market`` whose instrument ``index`` has new random bars first..last (incl.)."""
    ins = market.instruments[index]
    last = len(ins) - 1 if last is None else last
    sl = slice(first, last + 1)
    m = last + 1 - first
    arrays = {k: np.array(getattr(ins, k)) for k in ("open", "high", "low", "close", "volume")}
    close = arrays["close"][sl] * np.exp(rng.normal(0, 0.05, m))
    open_ = close * np.exp(rng.normal(0, 0.02, m))
    arrays["close"][sl], arrays["open"][sl] = close, open_
    arrays["high"][sl] = np.maximum(open_, close) * 1.03
    arrays["low"][sl] = np.minimum(open_, close) * 0.97
    arrays["volume"][sl] = rng.lognormal(14, 1.0, m)
    new = Instrument(ins.name, ins.source, ins.timestamps, **arrays)
    ins_all = market.instruments[:index] + (new,) + market.instruments[index + 1:]
    return MarketData(ins_all, market.bar_seconds, market.bars_per_year)
