"""The trading env as a gymnax 1.x ``Environment``, for gymnax wrappers and PureJaxRL-style code.

Requires the optional ``gymnax`` package (>= 1.0: ``step`` returns obs, state, reward,
terminated, truncated, info), so :mod:`foxhunt_jax.env` does not import this module.

The rules stay those of :mod:`foxhunt_jax.env.trading`: ``reset_env`` is ``trading.reset`` and
``step_env`` is ``trading.step_env``; gymnax's own ``Environment.step`` adds the auto-reset.
That ``step`` splits its key and resets with the second half, so ``env.step(key, ...)`` gives
exactly ``trading.step(jax.random.split(key)[1], ...)`` (``trading.step_env`` ignores its key).

The action is the branching action of the trading env: a tuple with one int per branch
(exposure, then take-profit and stop-loss when they exist), or an int array [B].
:class:`FlatActionWrapper` turns it into one ``Discrete(prod(sizes))`` action for code that
expects a single discrete action.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from gymnax.environments import environment, spaces
from gymnax.wrappers.purerl import GymnaxWrapper

from foxhunt_jax.config import EnvConfig
from foxhunt_jax.data.features import CLIP as FEATURE_CLIP, MarketTables, build_tables
from foxhunt_jax.data.market import MarketData
from foxhunt_jax.env import trading
from foxhunt_jax.env.trading import EnvParams, EnvState
from foxhunt_jax.errors import ConfigError

F32_MAX = float(np.finfo(np.float32).max)


def param_branch_sizes(params: EnvParams) -> tuple[int, ...]:
    """Sizes of the action branches of ``params`` (static: array shapes and static fields)."""
    sizes = [params.exposures.shape[0]]
    if params.has_take_profit:
        sizes.append(params.take_profit.shape[0])
    if params.has_stop_loss:
        sizes.append(params.stop_loss.shape[0])
    return tuple(int(n) for n in sizes)


def action_array(action) -> jax.Array:
    """A branching action (tuple/list of per-branch ints, or an int array [..., B]) -> int32
    array [..., B], the form :func:`trading.step_env` takes."""
    if isinstance(action, (tuple, list)):
        return jnp.stack([jnp.asarray(a, jnp.int32) for a in action], axis=-1)
    return jnp.asarray(action, jnp.int32)


class TradingEnv(environment.Environment[EnvState, EnvParams]):
    """The trading env of one split of one market (tables and settings live in the params).

    Build it with :meth:`from_market`; ``default_params`` are the params it was built with.
    Pass the params explicitly to ``reset``/``step`` under ``jit`` so that the tables are
    arguments rather than constants baked into the compiled program.
    """

    def __init__(self, params: EnvParams):
        super().__init__()
        self._params = params
        self.branch_sizes = param_branch_sizes(params)

    @classmethod
    def from_market(cls, market: MarketData | MarketTables, env_cfg: EnvConfig = EnvConfig(),
                    split: str = "train") -> tuple["TradingEnv", EnvParams]:
        """(env, params) of ``split`` of a market.

        ``market``: a :class:`MarketData` (its tables are built with the default features and
        ``env_cfg.episode_length``) or :class:`MarketTables` already built, whose episode
        length must be at least ``env_cfg.episode_length`` (its starts leave room for that
        many steps).
        """
        if isinstance(market, MarketData):
            market = build_tables(market, episode_length=env_cfg.episode_length)
        if env_cfg.episode_length > market.episode_length:
            raise ConfigError(
                f"env.episode_length {env_cfg.episode_length} exceeds the episode length "
                f"{market.episode_length} the market tables were built for")
        env = cls(trading.make_params(market, env_cfg, split))
        return env, env.default_params

    @property
    def default_params(self) -> EnvParams:
        return self._params

    def reset_env(self, key: jax.Array, params: EnvParams) -> tuple[jax.Array, EnvState]:
        return trading.reset(key, params)

    def step_env(self, key: jax.Array, state: EnvState, action, params: EnvParams):
        """One step without auto-reset -> (obs, state, reward, terminated, info).

        ``info``: the trading info (equity, cost, traded, exit_price, barrier, fills, turnover),
        plus ``exposure`` (the exposure the action chose) and ``discount`` (0 on ruin, else 1).
        Truncation is read back from the new state by :meth:`is_truncated`.
        """
        action = action_array(action)
        sizes = param_branch_sizes(params)
        if action.shape[-1:] != (len(sizes),):
            raise ValueError(f"the trading action has {len(sizes)} branches {sizes}, "
                             f"got an action of shape {action.shape}")
        obs, new_state, reward, terminated, _, info = trading.step_env(key, state, action,
                                                                      params)
        info = {**info, "exposure": params.exposures[action[..., 0]],
                "discount": 1.0 - terminated.astype(jnp.float32)}
        return obs, new_state, reward, terminated, info

    def get_obs(self, state: EnvState, params: EnvParams | None = None, key=None) -> jax.Array:
        return trading.observation(state, self._params if params is None else params)

    def is_terminated(self, state: EnvState, params: EnvParams) -> jax.Array:
        """Ruin: a ruined step leaves equity below ``ruin_floor`` (closing a position only
        lowers it), every other step leaves it at or above the floor."""
        return state.equity < params.ruin_floor

    def is_truncated(self, state: EnvState, params: EnvParams) -> jax.Array:
        """The step limit, on an episode that did not end in ruin (the trading module's rule)."""
        return (state.step >= params.episode_length) & ~self.is_terminated(state, params)

    @property
    def name(self) -> str:
        return "FoxhuntTrading"

    @property
    def num_actions(self) -> int:
        """The number of distinct branching actions, ``prod(branch_sizes)``."""
        return int(np.prod(self.branch_sizes))

    def action_space(self, params: EnvParams | None = None) -> spaces.Tuple:
        sizes = self.branch_sizes if params is None else param_branch_sizes(params)
        return spaces.Tuple([spaces.Discrete(n) for n in sizes])

    def observation_space(self, params: EnvParams | None = None) -> spaces.Box:
        """Features in [-FEATURE_CLIP, FEATURE_CLIP] (normalized and clipped), then the portfolio:
        exposure within the exposures and 0, unrealized P&L unbounded, time in trade in
        [0, 1], barrier distances in [-OBS_CLIP, OBS_CLIP], log equity above log(floor)."""
        params = self._params if params is None else params
        n_features = trading.obs_dim(params) - trading.P
        exposures = np.asarray(params.exposures, np.float32)
        clip = trading.OBS_CLIP
        low = [-FEATURE_CLIP] * n_features + [
            min(float(exposures.min()), 0.0), -F32_MAX, 0.0, -clip, -clip,
            float(jnp.log(jnp.float32(trading.EQUITY_FLOOR)))]
        high = [FEATURE_CLIP] * n_features + [
            max(float(exposures.max()), 0.0), F32_MAX, 1.0, clip, clip, F32_MAX]
        return spaces.Box(jnp.asarray(low, jnp.float32), jnp.asarray(high, jnp.float32),
                          (n_features + trading.P,), jnp.float32)


class FlatActionWrapper(GymnaxWrapper):
    """One ``Discrete(prod(sizes))`` action in place of the branching tuple.

    Flat index ``i`` is the branch tuple ``numpy.unravel_index(i, sizes)`` (branch 0 varies
    slowest), so single-discrete code (e.g. PureJaxRL's DQN/PPO) runs unchanged.
    """

    def __init__(self, env):
        super().__init__(env)
        space = env.action_space(env.default_params)
        if not isinstance(space, spaces.Tuple) or not all(
                isinstance(s, spaces.Discrete) for s in space.spaces):
            raise ValueError("FlatActionWrapper needs a Tuple of Discrete action spaces")
        self.branch_sizes = tuple(int(s.n) for s in space.spaces)

    def branch_action(self, flat_action) -> tuple[jax.Array, ...]:
        """Flat action (int, any batch shape) -> the tuple of per-branch int32 actions."""
        flat = jnp.asarray(flat_action, jnp.int32)
        return tuple(a.astype(jnp.int32) for a in jnp.unravel_index(flat, self.branch_sizes))

    @property
    def num_actions(self) -> int:
        return int(np.prod(self.branch_sizes))

    def action_space(self, params=None) -> spaces.Discrete:
        return spaces.Discrete(self.num_actions)

    @partial(jax.jit, static_argnames=("self",))
    def step(self, key: jax.Array, state, action, params=None):
        return self._env.step(key, state, self.branch_action(action), params)


__all__ = ["TradingEnv", "FlatActionWrapper", "param_branch_sizes", "action_array"]
