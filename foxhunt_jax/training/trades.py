"""The trade log of a greedy walk: the walk's actions replayed through the env's own step.

The walk (:func:`foxhunt_jax.training.validate.greedy_rollout`, on either backend) records the
actions it took; :func:`replay_walk` steps the same episodes with those actions through
:func:`foxhunt_jax.env.trading.step_env` and keeps what a trade log needs from the step's
``info`` (costs, barrier exits and their prices), so the walk itself carries nothing extra.
The env is deterministic: the replay's equity is the walk's.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from foxhunt_jax.env import trading
from foxhunt_jax.files import write_atomic
from foxhunt_jax.jitcache import compile_cached, jit
from foxhunt_jax.training.metrics import TRADE_COLUMNS, trade_log


def replay_steps(env_params, starts, lengths, actions):
    """Episodes from ``starts [W]`` stepped with ``actions [W, L, B]`` for ``lengths [W]`` steps
    or until ruin (no reset); returns the ``[L, W]`` arrays :func:`trade_log` reads."""
    steps = actions.shape[1]
    _, state = jax.vmap(trading.reset_at, in_axes=(0, None))(starts, env_params)
    step_v = jax.vmap(trading.step_env, in_axes=(None, 0, 0, None))

    def body(carry, xs):
        state, alive = carry
        action, t = xs
        alive = alive & (t < lengths)
        _, new, _, terminated, _, info = step_v(jax.random.key(0), state, action, env_params)
        fill_bar = state.bar + (1 if env_params.fill_next_open else 0)  # env.fill
        out = {"bar": state.bar, "fill_bar": fill_bar, "fill_price": info["fill_price"],
               "target": env_params.exposures[action[:, 0]],
               "traded": info["traded"] & alive, "cost": jnp.where(alive, info["cost"], 0.0),
               "barrier": jnp.where(alive, info["barrier"], trading.NONE),
               "exit_price": info["exit_price"],
               "equity": jnp.where(alive, info["equity"], jnp.nan),
               "terminated": terminated & alive, "alive": alive}
        state = jax.tree.map(lambda a, b: jnp.where(alive, a, b), new, state)
        return (state, alive & ~terminated), out

    alive = jnp.ones(starts.shape, bool)
    _, out = jax.lax.scan(body, (state, alive), (jnp.swapaxes(actions, 0, 1), jnp.arange(steps)))
    return out


def walk_trades(env_params, starts: np.ndarray, lengths: np.ndarray, actions: np.ndarray,
                tables, config) -> list[dict]:
    """:func:`trade_log` of a walk of the instruments starting at ``starts`` (global bars of
    ``tables``) that took ``actions [W, L, B]``; ``config`` keys the executable cache."""
    args = (env_params, jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(actions, jnp.int32))
    compiled, _ = compile_cached(jit(replay_steps), args, name="evaluate_trades",
                                 config={"config": config, "steps": int(actions.shape[1])})
    steps = {k: np.asarray(v).T for k, v in jax.device_get(compiled(*args)).items()}
    names = [tables.instrument_names[int(tables.instrument[s])] for s in starts]
    return trade_log(steps, np.asarray(tables.close, np.float64), tables.timestamps, names)


def write_trades_csv(path: str | os.PathLike, trades: list[dict]) -> Path:
    """Writes the trades as CSV (``TRADE_COLUMNS``; times as ISO 8601) atomically."""
    text = io.StringIO(newline="")
    out = csv.writer(text)
    out.writerow(TRADE_COLUMNS)
    for t in trades:
        out.writerow([_cell(t[c]) for c in TRADE_COLUMNS])
    return write_atomic(path, text.getvalue())


def _cell(value) -> str:
    if isinstance(value, np.datetime64):
        return str(np.datetime64(value, "s"))
    if isinstance(value, float):
        return repr(value)
    return str(value)


__all__ = ["replay_steps", "walk_trades", "write_trades_csv"]
