"""The Pallas backend of the trading env's rollouts: collection and greedy evaluation.

With ``network.backend=pallas``, :func:`foxhunt_jax.training.collect.trajectory` and
:func:`foxhunt_jax.training.validate.greedy_rollout` run their whole timestep loop in one kernel
(:func:`pallas_kernels.rollout.fused_rollout`) instead of a ``lax.scan`` that launches several
kernels per step, up to :data:`MAX_KERNEL_EPISODES` episodes (above it, the scan with the fused
Q-forward is faster; :func:`use_rollout_kernel`). This module only adapts arguments and
results: the random draws come from the same keys and functions as in the scan
(``collect.step_keys``, ``explore_draws``, ``trading.start_bar``; :func:`rollout_draws`) and
the results have the scan's layout, so the two backends are interchangeable and tested equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from foxhunt_jax.agent.network import explore_draws
from foxhunt_jax.env import trading

# Above this many parallel episodes the scan of per-step kernels (fused Q-forward, XLA env step)
# beats the one-kernel rollout on an H200: 16k episodes x 100 steps took 6.5 ms in the kernel and
# 10.3 ms in the scan, 256k took 85.9 ms and 64.5 ms (BENCHMARKS.md; the fitted crossover is about
# 53k). The kernel holds every episode's state and the whole network's activations in one
# program's registers, which pays while launches dominate and costs occupancy once they do not.
MAX_KERNEL_EPISODES = 1 << 15


def rollout_spans(num_steps: int) -> tuple[tuple[int, int], ...]:
    """The steps ``[start, stop)`` of each launch of a collection rollout kernel: the first
    three quarters, then the rest (one launch under 4 steps).

    The second launch continues from the first one's end state with the next steps' draws, so
    the trajectory is the same. What the split buys: the curiosity pass over the first launch's
    next observations (:func:`foxhunt_jax.training.collect.novelty`, per span) no longer waits
    for the whole rollout. It runs beside the second launch, on the multiprocessors a rollout
    of a few thousand episodes leaves idle, and only the last quarter's pass is left after the
    rollout (BENCHMARKS.md, session 16).
    """
    tail = num_steps // 4
    if tail < 1:
        return ((0, num_steps),)
    return ((0, num_steps - tail), (num_steps - tail, num_steps))


def use_rollout_kernel(learner, num_episodes: int) -> bool:
    """Whether a rollout of ``num_episodes`` parallel episodes runs as one kernel: the Pallas
    backend and at most :data:`MAX_KERNEL_EPISODES` episodes."""
    return learner.net_cfg.backend == "pallas" and num_episodes <= MAX_KERNEL_EPISODES


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


def collect_trajectory(learner, env_params, agent_params, rollout, keys: jax.Array, epsilon,
                       num_steps: int):
    """The ``fused`` backend of :func:`foxhunt_jax.training.collect.trajectory` for the trading
    env; ``keys [L, 3]`` are :func:`~foxhunt_jax.training.collect.step_keys`."""
    from foxhunt_jax.training.collect import Rollout
    from pallas_kernels.rollout import fused_rollout, portfolio

    net = learner.network
    draws, reset_bars = rollout_draws(net.branch_sizes, env_params, keys, rollout.obs.shape[0],
                                      epsilon)
    end, parts = rollout.env_state, []
    for start, stop in rollout_spans(num_steps):
        part, end = fused_rollout(agent_params, net, learner.support, env_params, end,
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


def evaluate_trajectory(learner, agent_params, env_params, starts: jax.Array, num_steps: int,
                        lengths: jax.Array | None = None) -> dict:
    """Greedy episodes from ``starts [W]`` without reset, as raw ``[L, W]`` step results
    (:func:`pallas_kernels.rollout.fused_rollout` in ``evaluate`` mode); the caller masks them."""
    from pallas_kernels.rollout import fused_rollout, portfolio

    _, state = jax.vmap(trading.reset_at, in_axes=(0, None))(starts, env_params)
    out, _ = fused_rollout(agent_params, learner.network, learner.support, env_params, state,
                           num_steps, mode="evaluate", lengths=lengths)
    return dict(out, portfolio=portfolio(out), next_portfolio=portfolio(out, "next_portfolio"),
                step=jnp.arange(num_steps, dtype=jnp.int32)[:, None])


__all__ = ["collect_trajectory", "evaluate_trajectory", "rollout_draws", "rollout_spans",
           "use_rollout_kernel", "MAX_KERNEL_EPISODES"]
