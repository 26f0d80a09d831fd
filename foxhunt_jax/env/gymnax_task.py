"""Any gymnax environment with discrete actions, as the trainer runs it (``env.name: <gymnax id>``).

:func:`make_task` builds a :class:`GymnaxTask` from a gymnax id (``CartPole-v1``,
``MountainCar-v0``, ...). Its ``reset``/``step_env`` have the trading env's signatures
(:mod:`foxhunt_jax.env.trading`): the action is an int array ``[1]`` (one branch of
``num_actions``), the observation is flattened to float32 ``[D]``, and ``step_env`` returns
``(obs, state, reward, terminated, truncated, info)`` without auto-reset. The state is the
env's state as a dict of its fields (a tree of standard containers, which compiled programs
can be stored with).

Termination and truncation follow gymnax 1.x's own split: ``terminated`` is what the env's
``step_env`` returns (its natural end: a fallen pole, a reached goal; no bootstrap), and
``truncated`` is the env's ``is_truncated`` (the step count reached ``max_steps_in_episode``;
bootstrap) where the step did not also terminate.

gymnax is an optional dependency (the ``gymnax`` extra): it is imported when a task is made, so
the trading env needs none of it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from foxhunt_jax.errors import ConfigError

TRADING = "trading"  # env.name of the trading env; every other name is a gymnax id


@dataclass(frozen=True, eq=False)  # hashed by identity: its functions key jitted programs
class GymnaxTask:
    """A gymnax env and its default params, with the step of the module docstring."""

    name: str
    env: Any  # gymnax.environments.environment.Environment
    params: Any  # its EnvParams
    state_type: type  # its EnvState class

    @property
    def num_actions(self) -> int:
        return int(self.env.num_actions)

    @property
    def max_steps(self) -> int:
        """Steps after which an episode is truncated."""
        return int(self.params.max_steps_in_episode)

    def step_limit(self, params) -> int:
        """:attr:`max_steps` (static, whatever ``params`` holds under a trace)."""
        del params
        return self.max_steps

    @property
    def obs_dim(self) -> int:
        """Width of the flattened observation."""
        obs = jax.eval_shape(self.env.reset_env, jax.random.key(0), self.params)[0]
        return math.prod(obs.shape)

    def reset(self, key: jax.Array, params) -> tuple[jax.Array, dict]:
        obs, state = self.env.reset_env(key, params)
        return _flat(obs), _fields(state)

    def step_env(self, key: jax.Array, state: dict, action: jax.Array, params):
        obs, state2, reward, terminated, info = self.env.step_env(
            key, self.state_type(**state), action[0], params)
        terminated = jnp.asarray(terminated, bool)
        truncated = jnp.asarray(self.env.is_truncated(state2, params), bool) & ~terminated
        return (_flat(obs), _fields(state2), jnp.asarray(reward, jnp.float32), terminated,
                truncated, info)


def _flat(obs) -> jax.Array:
    return jnp.ravel(jnp.asarray(obs, jnp.float32))


def _fields(state) -> dict:
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


def make_task(name: str) -> GymnaxTask:
    """The :class:`GymnaxTask` of gymnax id ``name``; ConfigError (naming ``env.name``) when
    gymnax is not installed, the id is unknown or its actions are not one discrete set."""
    try:
        import gymnax  # optional dependency (the `gymnax` extra)
        from gymnax.environments import spaces
    except ImportError as e:
        raise ConfigError(f"config key 'env.name' {name!r} is a gymnax environment and needs the "
                          "optional gymnax package: pip install 'foxhunt-jax[gymnax]' (import "
                          f"failed: {e})") from None
    known = list(gymnax.registered_envs)
    if name not in known:
        raise ConfigError(f"config key 'env.name' must be {TRADING} or a gymnax id such as "
                          f"CartPole-v1 or MountainCar-v0, got {name!r} (gymnax knows: "
                          f"{', '.join(known)})")
    env, params = gymnax.make(name)
    if not isinstance(env.action_space(params), spaces.Discrete):
        raise ConfigError(f"config key 'env.name': {name} has no discrete action set (the agent "
                          "picks one of num_actions)")
    state_type = type(jax.eval_shape(env.reset_env, jax.random.key(0), params)[1])
    return GymnaxTask(name, env, params, state_type)


__all__ = ["GymnaxTask", "TRADING", "make_task"]
