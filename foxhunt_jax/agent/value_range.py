"""The C51 support's range: derived from the returns an env can produce (``network.support:
auto``), and the warning when the learner's targets fall off it.

``network.support: explicit`` keeps ``[network.v_min, network.v_max]`` as given. ``auto``
replaces them where the env and its data are known: :func:`resolve_trading` (the trading env,
from the training split only) and :func:`resolve_gymnax` (a gymnax env, from the rewards a
random policy meets). docs/agent.md states both derivations.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from foxhunt_jax.config import Config, EnvConfig, replace
from foxhunt_jax.data.features import MarketTables
from foxhunt_jax.env.gymnax_task import GymnaxTask
from foxhunt_jax.errors import ConfigError

# share of target probability clipped onto the edge atoms above which a run warns (once)
EDGE_MASS_WARNING = 0.05
# the trading range is the holding returns' range widened by this fraction on each side
TRADING_MARGIN = 0.25
# the random-policy rollout a gymnax env's range is observed on: envs x steps
RANDOM_ROLLOUT_ENVS, RANDOM_ROLLOUT_STEPS = 16, 1000


def horizon_weight(gamma: float, horizon: int | None = None) -> float:
    """``sum_{k < horizon} gamma^k``; ``horizon`` None: the infinite sum ``1 / (1 - gamma)``.

    A learner that bootstraps at truncation learns infinite-horizon values (the time left is
    not in the observation), so its support needs the infinite sum; ``gamma = 1`` has none.
    """
    if horizon is None:
        if not gamma < 1:
            raise ValueError("horizon_weight: gamma = 1 needs a finite horizon")
        return 1.0 / (1.0 - gamma)
    return float(horizon) if gamma == 1 else (1.0 - gamma ** horizon) / (1.0 - gamma)


def discounted_range(reward_lo: float, reward_hi: float, gamma: float,
                     horizon: int | None = None) -> tuple[float, float]:
    """``(v_min, v_max)`` holding every discounted return whose per-step rewards lie in
    ``[reward_lo, reward_hi]``, over ``horizon`` steps (None: unbounded, as values learned with
    bootstrapped truncation are), and 0.

    The range is ``[min(0, reward_lo * G), max(0, reward_hi * G)]`` with ``G`` the
    :func:`horizon_weight`: exact bounds (a constant reward's value sits on the edge), so no
    margin is added.
    """
    if not reward_lo <= reward_hi:
        raise ValueError(f"discounted_range: reward_lo {reward_lo} > reward_hi {reward_hi}")
    g = horizon_weight(gamma, horizon)
    lo, hi = min(0.0, reward_lo * g), max(0.0, reward_hi * g)
    if lo == hi:  # every reward is 0: any range holds the returns
        lo, hi = -1.0, 1.0
    return lo, hi


def holding_returns(tables: MarketTables, gamma: float) -> np.ndarray:
    """``sum_k gamma^k x_{t+k}`` of the close-to-close log returns ``x`` from every bar ``t``
    of every instrument's training segment to the segment's end, float64.

    The sums run past the episode's end because truncation bootstraps: the values the learner
    learns are such unbounded discounted sums. Only training bars are read: no look-ahead into
    validation or test.
    """
    out = []
    for first, last in np.asarray(tables.segments["train"], np.int64).reshape(-1, 2):
        close = np.asarray(tables.close[first:last + 1], np.float64)
        if close.size < 2:
            continue
        x = np.log(close[1:] / close[:-1])
        sums = np.empty_like(x)
        acc = 0.0
        for t in range(x.size - 1, -1, -1):  # H_t = x_t + gamma H_{t+1}
            acc = x[t] + gamma * acc
            sums[t] = acc
        out.append(sums)
    if not out:
        raise ConfigError("network.support=auto: the training split holds no bar-to-bar return "
                          "to derive the support from")
    return np.concatenate(out)


def trading_range(tables: MarketTables, env_cfg: EnvConfig, gamma: float) -> tuple[float, float]:
    """``(v_min, v_max)`` for the trading env: the range of the discounted returns of holding
    the largest long and the largest short exposure from every training bar
    (:func:`holding_returns`, reward ``reward_scale`` x exposure x log return), minus every
    step's largest trading cost, and 0; widened by :data:`TRADING_MARGIN` on each side."""
    sums = holding_returns(tables, gamma) * env_cfg.reward_scale
    values = [0.0]
    for exposure in (min(env_cfg.exposures), max(env_cfg.exposures)):
        values += [float(np.min(exposure * sums)), float(np.max(exposure * sums))]
    # a reversal and a barrier exit in one step, and two fixed costs against the ruin floor
    largest = max(abs(e) for e in env_cfg.exposures)
    cost = 3 * largest * env_cfg.cost_bps / 1e4 + 2 * env_cfg.fixed_cost / env_cfg.ruin_floor
    step_cost = -env_cfg.reward_scale * math.log(max(1.0 - cost, 1e-6))
    weight = horizon_weight(gamma) if gamma < 1 else float(len(sums))
    lo = min(values) - step_cost * weight
    hi = max(values)
    return lo * (1 + TRADING_MARGIN), hi * (1 + TRADING_MARGIN)


def with_range(cfg: Config, v_min: float, v_max: float) -> Config:
    """``cfg`` with ``network.support: explicit`` and ``[v_min, v_max]`` (rounded to 4
    significant digits, outward), the form a run records in its config.yaml."""
    def outward(x: float, up: bool) -> float:
        if x == 0:
            return 0.0
        digits = 3 - math.floor(math.log10(abs(x)))
        return round((math.ceil if up else math.floor)(x * 10.0 ** digits) / 10.0 ** digits,
                     digits)
    return replace(cfg, network={"support": "explicit", "v_min": outward(v_min, False),
                                 "v_max": outward(v_max, True)})


def resolve_trading(cfg: Config, tables: MarketTables) -> Config:
    """``cfg`` unchanged under ``network.support: explicit``; under ``auto``, with the
    :func:`trading_range` of ``tables``' training split (:func:`with_range`)."""
    if cfg.network.support == "explicit":
        return cfg
    return with_range(cfg, *trading_range(tables, cfg.env, cfg.train.gamma))


def observed_rewards(task: GymnaxTask, key: jax.Array, envs: int = RANDOM_ROLLOUT_ENVS,
                     steps: int = RANDOM_ROLLOUT_STEPS) -> jax.Array:
    """``[steps, envs]`` per-step rewards of a uniformly random policy on ``task``, episodes
    restarting when they end."""
    reset_v = jax.vmap(task.reset, in_axes=(0, None))
    step_v = jax.vmap(task.step_env, in_axes=(0, 0, 0, None))
    k_reset, k_run = jax.random.split(key)
    _, state = reset_v(jax.random.split(k_reset, envs), task.params)

    def body(state, k):
        k_act, k_step, k_new = jax.random.split(k, 3)
        action = jax.random.randint(k_act, (envs, 1), 0, task.num_actions, jnp.int32)
        _, state2, reward, term, trunc, _ = step_v(jax.random.split(k_step, envs), state, action,
                                                   task.params)
        _, fresh = reset_v(jax.random.split(k_new, envs), task.params)
        done = term | trunc
        state2 = jax.tree.map(lambda a, b: jnp.where(done.reshape((-1,) + (1,) * (a.ndim - 1)),
                                                     a, b), fresh, state2)
        return state2, reward

    return jax.lax.scan(body, state, jax.random.split(k_run, steps))[1]


def gymnax_range(task: GymnaxTask, gamma: float, key: jax.Array) -> tuple[float, float]:
    """``(v_min, v_max)`` for a gymnax env: :func:`discounted_range` of the smallest and largest
    reward of :func:`observed_rewards` over an unbounded horizon (truncation bootstraps). A
    reward the random policy never meets (a goal it never reaches) is not in the range."""
    rewards = np.asarray(jax.device_get(jax.jit(lambda k: observed_rewards(task, k))(key)))
    if not gamma < 1:
        raise ConfigError("network.support=auto for a gymnax env needs train.gamma < 1 (the "
                          "values are unbounded sums); set network.support=explicit")
    return discounted_range(float(rewards.min()), float(rewards.max()), gamma)


def resolve_gymnax(cfg: Config, task: GymnaxTask) -> Config:
    """``cfg`` unchanged under ``network.support: explicit``; under ``auto``, with the
    :func:`gymnax_range` of ``task`` observed from ``fold_in(PRNGKey(train.seed), 1)``
    (:func:`with_range`)."""
    if cfg.network.support == "explicit":
        return cfg
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.train.seed), 1)
    return with_range(cfg, *gymnax_range(task, cfg.train.gamma, key))


def edge_mass_warning(epoch: int, edge_mass: float, v_min: float, v_max: float) -> str | None:
    """The one warning line a run prints when an epoch's ``support_edge_mass`` exceeds
    :data:`EDGE_MASS_WARNING`, else None."""
    if not edge_mass > EDGE_MASS_WARNING:
        return None
    return (f"warning: epoch {epoch}: {edge_mass:.1%} of the C51 target probability fell outside "
            f"the support [{v_min:g}, {v_max:g}] and was clipped onto its edge atoms (above "
            f"{EDGE_MASS_WARNING:.0%}): the support does not fit the returns; set "
            "network.support=auto, or network.support=explicit with network.v_min and "
            "network.v_max around the returns")


__all__ = ["EDGE_MASS_WARNING", "TRADING_MARGIN", "horizon_weight", "discounted_range",
           "holding_returns", "trading_range", "with_range", "resolve_trading",
           "observed_rewards", "gymnax_range", "resolve_gymnax", "edge_mass_warning"]
