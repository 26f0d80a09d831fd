"""Random Network Distillation curiosity.

A fixed, randomly initialised target network ``f`` and a trained predictor ``g`` of the same
architecture (``D -> hidden -> hidden -> embed``, ReLU) both embed the next observation. The raw
novelty of ``s'`` is the squared prediction error ``e = ||g(s') - f(s')||^2`` (summed over the
embedding); it is large for observations unlike those the predictor was trained on.

The intrinsic reward is ``coef * e / std(e)``, with ``std`` the running standard deviation of every
raw error seen so far (no mean is subtracted, so the bonus stays non-negative). Functions are
pure: ``intrinsic_reward`` uses the statistics as they were *before* the current batch, and the
caller folds the batch in afterwards with ``update_stats``. ``coef = 0`` turns curiosity off: the
bonus is exactly zero (no network is evaluated), so ``reward + bonus == reward`` bit for bit.

Typical use in one epoch::

    raw = prediction_error(rnd, next_obs)          # [N]
    bonus = scale_bonus(rnd, raw)                  # [N]  (== intrinsic_reward(rnd, next_obs))
    rnd = update_stats(rnd, raw)                   # after the batch
    rnd, loss = update(rnd, next_obs_batch)        # in the learner step

Precision: ``cfg.precision`` picks the algorithm of the GEMMs of 1,024 rows and more (the pass
over collected observations): ``"float32"`` (bf16 x6, f32-accurate) or ``"bf16x3"`` (three bf16
products; ~1e-3 relative error of the novelty late in a run); ``"auto"`` is decided by the
learner from the Q-network's dtype (:func:`resolve_precision`). The predictor's update at a
learner batch always multiplies in true f32.

Shapes: ``N``/``M`` observations, ``D`` observation width, ``E`` embedding width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from foxhunt_jax.agent.network import Dense, init_params
from foxhunt_jax.config import CuriosityConfig

_VAR_EPS = 1e-8  # keeps the normaliser finite when every raw error seen so far is equal


class RNDNetwork(nn.Module):
    """``[..., D] -> [..., E]`` MLP: two ReLU hidden layers of ``hidden`` units, linear output.

    ``fast``: from 1,024 rows, three bf16 products per GEMM instead of f32-accurate ones
    (:data:`~foxhunt_jax.agent.network.F32_FAST_PRECISION`).
    """

    hidden: int
    embed: int
    fast: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        # never TF32 or one bf16 product: late in a run the novelty is a small difference of
        # two embeddings, which those get wrong by far more than bf16 x3 does
        dense = lambda n, name: Dense(n, jnp.float32, self.fast, name=name)
        x = nn.relu(dense(self.hidden, "hidden_0")(x))
        x = nn.relu(dense(self.hidden, "hidden_1")(x))
        return dense(self.embed, "out")(x)


@struct.dataclass
class RNDState:
    """RND parameters, predictor optimizer state and running statistics of the raw error.

    Attributes:
      target_params: parameters of ``f`` (never updated).
      predictor_params: parameters of ``g``.
      opt_state: Adam state of the predictor.
      count: ``float32`` scalar, raw errors folded into the statistics so far.
      mean, var: ``float32`` scalars, their running mean and (population) variance.
      cfg: the :class:`CuriosityConfig` (static: part of the jit cache key, not a leaf).
    """

    target_params: Any
    predictor_params: Any
    opt_state: Any
    count: jax.Array
    mean: jax.Array
    var: jax.Array
    cfg: CuriosityConfig = struct.field(pytree_node=False)


def _network(cfg: CuriosityConfig) -> RNDNetwork:
    # "auto" is decided by the learner (resolve_precision); left undecided it means float32
    return RNDNetwork(hidden=cfg.hidden, embed=cfg.embed, fast=cfg.precision == "bf16x3")


def resolve_precision(cfg: CuriosityConfig, network_dtype: str) -> CuriosityConfig:
    """``cfg`` with ``precision="auto"`` decided: ``"bf16x3"`` for a bfloat16 Q-network (whose
    own products round far more), else ``"float32"``."""
    if cfg.precision != "auto":
        return cfg
    return dataclasses.replace(cfg, precision="bf16x3" if network_dtype == "bfloat16"
                               else "float32")


def _optimizer(cfg: CuriosityConfig) -> optax.GradientTransformation:
    # on one raveled vector: fewer kernels per learner step
    return optax.flatten(optax.adam(cfg.learning_rate))


def init(key: jax.Array, obs_dim: int, cfg: CuriosityConfig) -> RNDState:
    """Target and predictor from independent keys, zeroed statistics and a fresh Adam state."""
    if obs_dim < 1:
        raise ValueError(f"curiosity.init: obs_dim must be >= 1, got {obs_dim}")
    k_target, k_pred = jax.random.split(key)
    net = _network(cfg)
    dummy = jnp.zeros((1, obs_dim), jnp.float32)
    target = init_params(net, k_target, dummy)
    predictor = init_params(net, k_pred, dummy)
    zero = jnp.zeros((), jnp.float32)
    return RNDState(target_params=target, predictor_params=predictor,
                    opt_state=_optimizer(cfg).init(predictor), count=zero, mean=zero, var=zero,
                    cfg=cfg)


def _errors(net: RNDNetwork, predictor_params, target_params, obs: jax.Array) -> jax.Array:
    """Per-element squared differences ``[N, E]`` of predictor and (constant) target embeddings."""
    obs = jnp.asarray(obs, jnp.float32)
    target = jax.lax.stop_gradient(net.apply(target_params, obs))
    return jnp.square(net.apply(predictor_params, obs) - target)


def prediction_error(state: RNDState, obs: jax.Array) -> jax.Array:
    """Raw novelty ``||g(s) - f(s)||^2``: ``obs [N, D] -> [N] float32``.

    The definition that :mod:`foxhunt_jax.backend` serves (its ``pallas`` backend runs it as
    one kernel where the precision and the widths allow, tested equal).
    """
    return jnp.sum(_errors(_network(state.cfg), state.predictor_params, state.target_params, obs),
                   axis=-1)


def scale_bonus(state: RNDState, raw: jax.Array, coef=None) -> jax.Array:
    """``coef * raw / std`` with the running std (1 before any statistics). ``[N] -> [N]``.

    ``coef``: default ``state.cfg.coef``; a traced ``[]`` array is a population member's own.
    Exactly zero when ``coef == 0``.
    """
    raw = jnp.asarray(raw, jnp.float32)
    coef = state.cfg.coef if coef is None else coef
    if not isinstance(coef, jax.Array) and coef == 0:
        return jnp.zeros_like(raw)
    std = jnp.where(state.count > 0, jnp.sqrt(state.var + _VAR_EPS), 1.0)
    return jnp.asarray(coef, jnp.float32) * raw / std


def intrinsic_reward(state: RNDState, next_obs: jax.Array) -> jax.Array:
    """Curiosity bonus of each next observation: ``next_obs [N, D] -> [N] float32``.

    Uses the statistics before this batch (pure). ``coef == 0`` returns exact zeros without
    evaluating the networks.
    """
    if state.cfg.coef == 0:
        return jnp.zeros(next_obs.shape[:-1], jnp.float32)
    return scale_bonus(state, prediction_error(state, next_obs))


def update_stats(state: RNDState, raw: jax.Array) -> RNDState:
    """Folds a batch of raw errors ``[N]`` into the running mean and variance.

    Parallel (Chan et al.) combination of the stored ``(count, mean, var)`` with the batch's own
    two-pass mean and variance, so the result equals the mean/variance of all values seen, without
    the cancellation of a sum-of-squares formula.
    """
    raw = jnp.asarray(raw, jnp.float32)
    if raw.ndim != 1:
        raise ValueError(f"curiosity.update_stats expects raw prediction errors [N] "
                         f"(from prediction_error), got shape {raw.shape}")
    if raw.shape[0] == 0:
        return state
    n_b = jnp.float32(raw.shape[0])
    mean_b = jnp.mean(raw)
    var_b = jnp.mean(jnp.square(raw - mean_b))
    n = state.count + n_b
    frac_b = n_b / n
    frac_a = state.count / n
    delta = mean_b - state.mean
    mean = state.mean + delta * frac_b
    var = frac_a * state.var + frac_b * var_b + jnp.square(delta) * frac_a * frac_b
    return state.replace(count=n, mean=mean, var=var)


def update(state: RNDState, next_obs: jax.Array) -> tuple[RNDState, jax.Array]:
    """One Adam step of the predictor on the MSE ``mean((g(s') - f(s'))^2)`` over ``[M, E]``.

    Returns the new state and the loss before the step (``float32`` scalar). The target
    parameters are returned unchanged. With ``coef == 0`` nothing is trained and the loss is 0.
    """
    if state.cfg.coef == 0:
        return state, jnp.zeros((), jnp.float32)
    net = _network(state.cfg)

    def loss_fn(params):
        return jnp.mean(_errors(net, params, state.target_params, next_obs))

    loss, grads = jax.value_and_grad(loss_fn)(state.predictor_params)
    updates, opt_state = _optimizer(state.cfg).update(grads, state.opt_state,
                                                      state.predictor_params)
    params = optax.apply_updates(state.predictor_params, updates)
    return state.replace(predictor_params=params, opt_state=opt_state), loss


__all__ = [
    "RNDNetwork", "RNDState", "init", "resolve_precision", "prediction_error",
    "scale_bonus", "intrinsic_reward", "update_stats", "update",
]
