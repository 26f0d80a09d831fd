"""The learner's optimizer: clipping by the global norm, then Adam, one expression a leaf.

:func:`clipped_adam` computes what ``optax.chain(optax.clip_by_global_norm(max_norm),
optax.adam(learning_rate, b1, b2, eps))`` computes, in the same order of operations (the tests
compare the two), but writes each parameter's clip, moments, bias correction and step as one
expression of its gradient and state. XLA then updates a leaf in one pass over its gradient,
moments and parameters, and the learner adds the step to the parameters in the same pass. Its
state keeps the moments in the parameters' tree (``optax.flatten`` would ravel them into one
vector and copy the gradient in and the step out every update).

Shapes: the state's ``mu`` and ``nu`` are trees of the parameters' shapes, ``count`` is ``[]``
int32; under ``vmap`` (a population) every leaf gains the member axis.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class ClippedAdamState(NamedTuple):
    """Adam's state: ``count`` updates taken (``[]`` int32) and the first and second moments
    (``mu``, ``nu``: float32 trees shaped as the parameters)."""

    count: jax.Array
    mu: Any
    nu: Any


def clipped_adam(learning_rate, max_norm: float, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8) -> optax.GradientTransformation:
    """Global-norm clipping at ``max_norm`` then Adam at ``learning_rate`` (a Python number or
    a traced ``[]`` array; the state does not depend on it). ``update(grads, state, params)``
    returns the steps to add to the parameters (``optax.apply_updates``) and the new state."""

    def init(params) -> ClippedAdamState:
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return ClippedAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros())

    def update(grads, state: ClippedAdamState, params=None):
        del params
        norm = optax.tree.norm(grads)
        within = norm < max_norm
        count = optax.safe_increment(state.count)
        mu_correction = 1 - b1 ** count
        nu_correction = 1 - b2 ** count

        def leaf(g, mu, nu):
            g = jax.lax.select(within, g, (g / norm.astype(g.dtype)) * max_norm)
            mu = (1 - b1) * g + b1 * mu
            nu = (1 - b2) * (g * g) + b2 * nu
            mu_hat = mu / mu_correction.astype(mu.dtype)
            nu_hat = nu / nu_correction.astype(nu.dtype)
            return -learning_rate * (mu_hat / (jnp.sqrt(nu_hat) + eps)), mu, nu

        out = jax.tree.map(leaf, grads, state.mu, state.nu)
        treedef = jax.tree.structure(grads)
        steps, mu, nu = (jax.tree.unflatten(treedef, part)
                         for part in zip(*treedef.flatten_up_to(out)))
        return steps, ClippedAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


__all__ = ["ClippedAdamState", "clipped_adam"]
