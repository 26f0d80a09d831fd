"""The trading env's rollouts as kernels: collection and greedy evaluation.

Where the :class:`~foxhunt_jax.backend.Backend` runs rollout kernels
(:meth:`~foxhunt_jax.backend.Backend.runs_rollout_kernel`),
:func:`foxhunt_jax.training.collect.trajectory` and
:func:`foxhunt_jax.training.validate.greedy_rollout` run their whole timestep loop in its kernel
(``backend.rollout``, :func:`pallas_kernels.rollout.fused_rollout`) instead of a ``lax.scan``
that launches several kernels per step. This module only adapts arguments and results: the
random draws come from the same keys and functions as in the scan (``collect.step_keys``,
``explore_draws``, ``trading.start_bar``; :func:`rollout_draws`) and the results have the
scan's layout, so the two forms are interchangeable and tested equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from foxhunt_jax.agent.network import explore_draws
from foxhunt_jax.backend import Backend
from foxhunt_jax.env import trading
from foxhunt_jax.training.collect import Rollout
from pallas_kernels.rollout import launch_spans, portfolio


def rollout_draws(branch_sizes, env_params, keys: jax.Array, num_episodes: int, epsilon):
    """The per-step random draws of a collection rollout, from ``keys [L, 3]``
    (:func:`~foxhunt_jax.training.collect.step_keys`), as the scan draws them: exploration
    ``[L, N, B]`` int32 (:func:`~foxhunt_jax.agent.network.explore_draws`, -1 = greedy) and
    reset start bars ``[L, N]`` int32 (:func:`~foxhunt_jax.env.trading.start_bar`)."""
    n = num_episodes
    draws = jax.vmap(lambda k: explore_draws(k, n, branch_sizes, epsilon))(keys[:, 0])
    start_v = jax.vmap(trading.start_bar, in_axes=(0, None))
    reset_bars = jax.vmap(lambda k: start_v(jax.random.split(k, n), env_params))(keys[:, 2])
    return draws, reset_bars


def collect_trajectory(learner, backend: Backend, env_params, agent_params, rollout,
                       keys: jax.Array, epsilon, num_steps: int):
    """The trading env's ``EnvAdapter.fused``: :func:`foxhunt_jax.training.collect.trajectory`
    as ``backend.rollout`` kernels, in the launches of
    :func:`pallas_kernels.rollout.launch_spans`; ``keys [L, 3]`` are
    :func:`~foxhunt_jax.training.collect.step_keys`."""
    net = learner.network
    draws, reset_bars = rollout_draws(net.branch_sizes, env_params, keys, rollout.obs.shape[0],
                                      epsilon)
    end, parts = rollout.env_state, []
    for start, stop in launch_spans(num_steps):
        part, end = backend.rollout(agent_params, net, learner.support, env_params, end,
                                    stop - start, mode="collect", draws=draws[start:stop],
                                    reset_bars=reset_bars[start:stop])
        parts.append(part)
    out = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts)
    traj = {"obs": {"bar": out["bar"], "portfolio": portfolio(out)},
            "next_obs": {"bar": out["next_bar"], "portfolio": portfolio(out, "next_portfolio")},
            "action": out["action"], "reward": out["reward"], "terminated": out["terminated"],
            "truncated": out["truncated"], "greedy": out["greedy"],
            "taken_logits": out["taken_logits"]}
    obs = jax.vmap(trading.observation, in_axes=(0, None))(end, env_params)
    return Rollout(env_state=end, obs=obs), traj


def evaluate_trajectory(learner, backend: Backend, agent_params, env_params, starts: jax.Array,
                        num_steps: int, lengths: jax.Array | None = None) -> dict:
    """Greedy episodes from ``starts [W]`` without reset, as raw ``[L, W]`` step results
    (``backend.rollout`` in ``evaluate`` mode); the caller masks them."""
    _, state = jax.vmap(trading.reset_at, in_axes=(0, None))(starts, env_params)
    out, _ = backend.rollout(agent_params, learner.network, learner.support, env_params, state,
                             num_steps, mode="evaluate", lengths=lengths)
    return dict(out, portfolio=portfolio(out), next_portfolio=portfolio(out, "next_portfolio"),
                step=jnp.arange(num_steps, dtype=jnp.int32)[:, None])


__all__ = ["collect_trajectory", "evaluate_trajectory", "rollout_draws"]
