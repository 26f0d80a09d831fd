"""The ``pallas`` backend: the agent's definitions as fused Pallas kernels, tested equal to them.

Each entry point takes the same arguments and gives the same results as the ``xla`` one
(:mod:`foxhunt_jax.backend.xla`), with the launch shapes of the device's
:class:`~pallas_kernels.tuning.Tuning` bound by :func:`entry_points`. The kernels have no
gradient; the learner's update keeps the Flax layers.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from foxhunt_jax.agent import curiosity
from foxhunt_jax.agent.network import F32_PRECISION_MIN_ROWS, QNetwork
from foxhunt_jax.config import CuriosityConfig
from pallas_kernels import rnd
from pallas_kernels.q_forward import (apply_draws, fused_act, fused_bootstrap_loss, fused_logits,
                                      fused_q_forward)
from pallas_kernels.rollout import fused_rollout
from pallas_kernels.tuning import Tuning


def rnd_kernel_applies(cfg: CuriosityConfig, rows: int) -> bool:
    """Whether the novelty of ``rows`` observations runs the curiosity kernel
    (:mod:`pallas_kernels.rnd`): the ``"bf16x3"`` precision (the kernel's arithmetic), at least
    :data:`~foxhunt_jax.agent.network.F32_PRECISION_MIN_ROWS` rows (below, the Flax GEMMs
    multiply in true f32) and widths the kernel takes. Elsewhere the Flax network runs."""
    return (cfg.precision == "bf16x3" and rows >= F32_PRECISION_MIN_ROWS
            and rnd.supports(cfg.hidden, cfg.embed))


def q_forward(tuning: Tuning, params: Any, obs: jax.Array, network: QNetwork, z: jax.Array, *,
              with_q: bool = False):
    """:func:`foxhunt_jax.agent.network.q_forward` (any leading axes) as one kernel."""
    lead, dim = obs.shape[:-1], obs.shape[-1]
    q, actions = fused_q_forward(params, obs.reshape(-1, dim), network, z, with_q=with_q,
                                 config=tuning.q_forward_config(network.dtype),
                                 interpret=not tuning.compiled)
    actions = actions.reshape(lead + (len(network.branch_sizes),))
    if q is not None:
        q = tuple(x.reshape(lead + (x.shape[-1],)) for x in q)
    return q, actions


def act(tuning: Tuning, params: Any, obs: jax.Array, draws: jax.Array, network: QNetwork,
        z: jax.Array):
    """:func:`foxhunt_jax.agent.network.act` as one kernel."""
    greedy, taken = fused_act(params, obs, network, z, draws,
                              config=tuning.q_forward_config(network.dtype),
                              interpret=not tuning.compiled)
    return greedy, apply_draws(draws, greedy), taken


def taken_logits(tuning: Tuning, params: Any, obs: jax.Array, actions: jax.Array,
                 network: QNetwork) -> tuple[jax.Array, ...]:
    """:func:`foxhunt_jax.agent.network.taken_logits` (any leading axes) as one kernel, which
    writes ``B * K`` floats a row instead of every action's logits."""
    lead, dim = obs.shape[:-1], obs.shape[-1]
    out = fused_logits(params, obs.reshape(-1, dim), network,
                       actions=actions.reshape(-1, actions.shape[-1]),
                       config=tuning.q_forward_config(network.dtype),
                       interpret=not tuning.compiled)
    return tuple(x.reshape(lead + x.shape[1:]) for x in out)


def bootstrap_loss(tuning: Tuning, target_params: Any, next_obs: jax.Array, best: jax.Array,
                   taken, returns: jax.Array, discounts: jax.Array, network: QNetwork,
                   support: jax.Array) -> jax.Array:
    """:func:`foxhunt_jax.agent.loss.bootstrap_loss` as one kernel: the target forward with the
    loss after it, one float written a row."""
    return fused_bootstrap_loss(target_params, next_obs, network, support, best, taken, returns,
                                discounts, config=tuning.q_forward_config(network.dtype),
                                interpret=not tuning.compiled)


def novelty(tuning: Tuning, state: curiosity.RNDState, obs: jax.Array) -> jax.Array:
    """:func:`foxhunt_jax.agent.curiosity.prediction_error`, as one kernel where
    :func:`rnd_kernel_applies`."""
    if rnd_kernel_applies(state.cfg, obs.shape[0]):
        return rnd.prediction_error(state.target_params, state.predictor_params, obs,
                                    config=tuning.rnd, interpret=not tuning.compiled)
    return curiosity.prediction_error(state, obs)


def rollout(tuning: Tuning, params: Any, network: QNetwork, support: jax.Array, env_params,
            state, num_steps: int, **kwargs):
    """:func:`pallas_kernels.rollout.fused_rollout` (same arguments) with the tuned launch: a
    collection rollout launches once a timestep where the tuning says so
    (:meth:`~pallas_kernels.tuning.Tuning.rollout_stepped`)."""
    stepped = (kwargs.get("mode", "collect") == "collect"
               and tuning.rollout_stepped(state.bar.shape[0], network.dtype))
    return fused_rollout(params, network, support, env_params, state, num_steps,
                         config=tuning.rollout_config(network.dtype),
                         interpret=not tuning.compiled, stepped=stepped, **kwargs)


def entry_points(tuning: Tuning) -> dict:
    """The backend's entry points with ``tuning`` bound."""
    return {name: functools.partial(fn, tuning) for name, fn in (
        ("q_forward", q_forward), ("act", act), ("taken_logits", taken_logits),
        ("bootstrap_loss", bootstrap_loss), ("novelty", novelty), ("rollout", rollout))}


__all__ = ["entry_points", "rnd_kernel_applies", "q_forward", "act", "taken_logits",
           "bootstrap_loss", "novelty", "rollout"]
