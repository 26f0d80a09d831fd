"""The C51 double-Q loss of the branching network and n-step targets.

Pure functions. Shapes: ``M`` batch, ``K`` atoms, ``B`` branches, ``n_d`` actions of branch d,
``L`` steps of a collection window, ``N`` episodes.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp

from foxhunt_jax.agent.network import greedy_actions, select_action, taken_logits
from foxhunt_jax.errors import ConfigError

# the largest train.n_step the config allows: the loop bound of a traced n
MAX_N_STEP = 5

# a shifted atom counts as clipped beyond this fraction of the atom spacing past an edge, so that
# a value on the edge (a constant reward's fixed point) is not counted by float rounding
EDGE_TOLERANCE = 1e-3


def _project(next_probs: jax.Array, returns: jax.Array, discounts: jax.Array,
             support: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`categorical_projection` and :func:`clipped_edge_mass` of the same inputs, from one
    computation of the shifted atoms."""
    chex.assert_rank([next_probs, returns, discounts, support], [2, 1, 1, 1])
    k = support.shape[0]
    chex.assert_shape(next_probs, (returns.shape[0], k))
    chex.assert_equal_shape([returns, discounts])
    v_min, v_max = support[0], support[-1]
    dz = (v_max - v_min) / (k - 1)
    shifted = returns[:, None] + discounts[:, None] * support[None, :]  # [M, K] unclipped
    tolerance = EDGE_TOLERANCE * dz
    outside = (shifted < v_min - tolerance) | (shifted > v_max + tolerance)
    edge_mass = jnp.sum(jnp.where(outside, next_probs, 0.0), axis=-1)
    tz = jnp.clip(shifted, v_min, v_max)
    b = jnp.clip((tz - v_min) / dz, 0.0, k - 1.0)  # [M, K] fractional target index per source atom
    idx = jnp.arange(k, dtype=b.dtype)
    w = jnp.maximum(0.0, 1.0 - jnp.abs(b[:, :, None] - idx[None, None, :]))  # [M, K_src, K_dst]
    # HIGHEST: on GPUs a default-precision f32 contraction may run in TF32 and lose mass.
    projected = jnp.einsum("mj,mji->mi", next_probs, w, precision=jax.lax.Precision.HIGHEST)
    return projected, edge_mass


def categorical_projection(next_probs: jax.Array, returns: jax.Array, discounts: jax.Array,
                           support: jax.Array) -> jax.Array:
    """Projects the distribution of ``returns + discounts * z`` onto the fixed support ``z``.

    Args:
      next_probs: ``[M, K]`` probabilities of the bootstrap distribution on ``z``.
      returns: ``[M]`` (n-step) returns.
      discounts: ``[M]`` bootstrap discounts (``gamma^k``, 0 where terminated).
      support: ``[K]`` evenly spaced atoms from v_min to v_max.

    Returns:
      ``[M, K]`` projected probabilities; each row sums to the row sum of ``next_probs``.

    Each shifted atom ``Tz = clip(r + d z_j, v_min, v_max)`` sits at fractional index
    ``b = (Tz - v_min) / dz`` and gives atom ``i`` the share ``max(0, 1 - |b - i|)`` of its mass.
    This triangular weight equals the usual split between ``floor(b)`` and ``ceil(b)`` and needs
    no special case when ``b`` is an integer (then all mass goes to that atom, none is lost).
    """
    return _project(next_probs, returns, discounts, support)[0]


def clipped_edge_mass(next_probs: jax.Array, returns: jax.Array, discounts: jax.Array,
                      support: jax.Array) -> jax.Array:
    """``[M]``: the probability that :func:`categorical_projection` clips onto the two edge
    atoms, the mass of the atoms whose shifted value ``r + d z_j`` lies outside
    ``[v_min, v_max]`` by more than :data:`EDGE_TOLERANCE` atom spacings. Arguments as
    :func:`categorical_projection`.

    Mass that lands on an edge atom from inside the support is not counted: a support that fits
    may hold a return on its edge, but clipped mass means returns beyond it.
    """
    return _project(next_probs, returns, discounts, support)[1]


def c51_loss_and_edge_mass(taken: Sequence[jax.Array], target_best: Sequence[jax.Array],
                           returns: jax.Array, discounts: jax.Array,
                           support: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`c51_loss` and, from the same projections, the target probability clipped onto
    the support's edge atoms (:func:`clipped_edge_mass` of each branch's bootstrap
    distribution), both ``[M]`` and averaged over branches. Arguments as :func:`c51_loss`."""
    if not len(taken) == len(target_best) >= 1:
        raise ValueError("c51_loss: taken and target_best need the same number of branches "
                         "(>= 1)")
    losses, edge_masses = [], []
    for taken_d, target_d in zip(taken, target_best):
        chex.assert_equal_shape([taken_d, target_d])
        p_next = jax.nn.softmax(target_d.astype(jnp.float32), axis=-1)
        m, edge = jax.lax.stop_gradient(_project(p_next, returns, discounts, support))
        log_p = jax.nn.log_softmax(taken_d.astype(jnp.float32), axis=-1)
        losses.append(-jnp.sum(m * log_p, axis=-1))
        edge_masses.append(edge)
    mean = lambda xs: jnp.mean(jnp.stack(xs, axis=0), axis=0)  # noqa: E731
    return mean(losses), mean(edge_masses)


def c51_loss(taken: Sequence[jax.Array], target_best: Sequence[jax.Array], returns: jax.Array,
             discounts: jax.Array, support: jax.Array) -> jax.Array:
    """Per-sample C51 loss from each branch's chosen logits, averaged over branches.

    Args:
      taken: tuple over branches of ``[M, K]`` online logits at s of the taken action.
      target_best: tuple over branches of ``[M, K]`` target-network logits at the bootstrap
        observation of the action the bootstrap picks (double Q: the online network's greedy
        action there).
      returns: ``[M]`` n-step returns.
      discounts: ``[M]`` bootstrap discounts (``gamma^k``, 0 where terminated).
      support: ``[K]`` atoms.

    Returns:
      ``[M]``: per branch, the cross-entropy between the projected target
      ``Phi(r + discount * z; softmax(target_best_d))`` and ``softmax(taken_d)``; then the mean
      over branches. Gradients flow only into ``taken``.
    """
    return c51_loss_and_edge_mass(taken, target_best, returns, discounts, support)[0]


def bootstrap_loss(target_params, next_obs: jax.Array, best: jax.Array,
                   taken: Sequence[jax.Array], returns: jax.Array, discounts: jax.Array, network,
                   support: jax.Array) -> jax.Array:
    """:func:`c51_loss` of given online logits against the target network's distribution at
    the bootstrap observation: ``c51_loss(taken, taken_logits(target_params, next_obs, best),
    returns, discounts, support)``.

    Args:
      target_params: the target network's parameters; ``network`` the ``QNetwork``.
      next_obs: ``[M, D]`` bootstrap observations.
      best: ``[M, B]`` int32, the action each branch bootstraps from (the online network's
        greedy action there).
      taken: tuple over branches of ``[M, K]`` online logits of the taken actions at s.
      returns, discounts, support: as :func:`c51_loss`.

    Returns:
      ``[M]`` float32, differentiable in ``taken``. The definition that
      :mod:`foxhunt_jax.backend`'s ``pallas`` backend runs as one kernel (no gradient).
    """
    return c51_loss(taken, taken_logits(target_params, next_obs, best, network), returns,
                    discounts, support)


def c51_double_q_loss(online_s: Sequence[jax.Array], online_next: Sequence[jax.Array],
                      target_next: Sequence[jax.Array], actions: jax.Array, returns: jax.Array,
                      discounts: jax.Array, support: jax.Array) -> jax.Array:
    """Per-sample distributional double-Q loss from every action's logits, averaged over
    branches: :func:`c51_loss` of the taken actions' online logits and the target logits of
    the online network's greedy actions at the bootstrap observation.

    Args:
      online_s: tuple over branches of online logits at s, ``[M, n_d, K]``.
      online_next: tuple of online logits at the bootstrap observation, ``[M, n_d, K]``.
      target_next: tuple of target-network logits at the bootstrap observation, ``[M, n_d, K]``.
      actions: ``[M, B]`` int32, the actions taken at s.
      returns: ``[M]`` n-step returns.
      discounts: ``[M]`` bootstrap discounts (``gamma^k``, 0 where terminated).
      support: ``[K]`` atoms.

    Returns:
      ``[M]`` loss: per branch d, the cross-entropy between the projected target
      ``Phi(r + discount * z; softmax(target_next_d[a*_d]))`` with
      ``a*_d = argmax_a E[Q_online_next_d(a)]`` (:func:`~foxhunt_jax.agent.network.
      greedy_actions`) and ``softmax(online_s_d[a_d])``; then the mean over branches.
      Gradients flow only into ``online_s``. Importance weights are applied by the caller.
    """
    n_branches = len(online_s)
    if not (len(online_next) == len(target_next) == n_branches >= 1):
        raise ValueError("c51_double_q_loss: online_s, online_next and target_next need the same "
                         "number of branches (>= 1)")
    chex.assert_shape(actions, (returns.shape[0], n_branches))
    for d in range(n_branches):
        chex.assert_equal_shape([online_s[d], online_next[d], target_next[d]])
    best = greedy_actions(online_next, support)  # [M, B]; an argmax has no gradient
    return c51_loss(tuple(select_action(l, actions[:, d]) for d, l in enumerate(online_s)),
                    tuple(select_action(l, best[:, d]) for d, l in enumerate(target_next)),
                    returns, discounts, support)


def n_step_targets(rewards: jax.Array, terminated: jax.Array, truncated: jax.Array, gamma: float,
                   n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """n-step returns, bootstrap discounts and bootstrap offsets of a collection window.

    Args:
      rewards: ``[L, N]`` reward of step t.
      terminated: ``[L, N]`` bool, step t ended its episode by termination (no bootstrap).
      truncated: ``[L, N]`` bool, step t ended its episode by truncation (bootstrap).
      gamma: discount factor (a float, or a traced ``[]`` array).
      n: the largest number of steps summed (>= 1): a Python integer (it sets the unrolled
        loop), or a traced int32 ``[]`` array in ``1..MAX_N_STEP`` (the loop runs
        ``MAX_N_STEP`` steps, those past ``n`` masked out; the same results).

    Returns:
      ``(returns [L, N], discounts [L, N], offsets [L, N] int32)``. For step t, ``k`` is the
      smallest of ``n``, the steps up to and including the first done step at or after t, and
      ``L - t`` (the window end counts as truncation). ``returns = sum_{i<k} gamma^i r_{t+i}``;
      ``discounts = 0`` when step ``t+k-1`` terminated, else ``gamma^k``; ``offsets = k``:
      the bootstrap observation is the next observation of step ``t + k - 1``.
    """
    traced_n = None
    if isinstance(n, jax.Array):  # a population member's n: the loop runs to the largest n
        traced_n, n = n, MAX_N_STEP
    try:  # a Python or NumPy integer; n sets the unrolled loop, so it is static
        n_int = None if isinstance(n, bool) else operator.index(n)
    except TypeError:
        n_int = None
    if n_int is None or n_int < 1:
        raise ConfigError(f"n_step_targets: n must be an integer >= 1, got {n!r}")
    n = n_int
    chex.assert_rank(rewards, 2)
    chex.assert_equal_shape([rewards, terminated, truncated])
    if not jnp.issubdtype(rewards.dtype, jnp.floating):
        rewards = rewards.astype(jnp.float32)
    length = rewards.shape[0]
    terminated = terminated.astype(bool)
    done = terminated | truncated.astype(bool)
    step = jnp.arange(length)[:, None]

    def ahead(x: jax.Array, i: int, fill) -> jax.Array:
        # x[t + i] for each t, ``fill`` past the window end.
        pad = jnp.full((min(i, length),) + x.shape[1:], fill, x.dtype)
        return jnp.concatenate([x[i:], pad], axis=0)

    ret = jnp.zeros_like(rewards)
    k = jnp.zeros(rewards.shape, jnp.int32)
    ended_terminal = jnp.zeros(rewards.shape, bool)
    alive = jnp.ones(rewards.shape, bool)  # step t+i belongs to the k-step window of t
    for i in range(n):
        if traced_n is not None:  # steps past the member's own n leave the window
            alive = alive & (i < traced_n)
        ret = ret + jnp.where(alive, (gamma ** i) * ahead(rewards, i, 0), 0).astype(rewards.dtype)
        k = k + alive.astype(jnp.int32)
        ended_terminal = ended_terminal | (alive & ahead(terminated, i, False))
        alive = alive & ~ahead(done, i, True) & (step + i + 1 < length)
    discounts = jnp.where(ended_terminal, 0.0, jnp.power(jnp.asarray(gamma, rewards.dtype), k))
    return ret, discounts.astype(rewards.dtype), k


__all__ = ["categorical_projection", "clipped_edge_mass", "c51_loss", "c51_loss_and_edge_mass",
           "bootstrap_loss", "c51_double_q_loss", "n_step_targets"]
