"""The learner's optimizer (agent/optimizer.py) against optax's chain and a float64 NumPy Adam."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from foxhunt_jax.agent.optimizer import ClippedAdamState, clipped_adam

SHAPES = {"trunk": {"kernel": (7, 5), "bias": (5,)}, "head": {"kernel": (5, 3)}, "scale": ()}


def random_tree(rng: np.random.Generator, scale: float = 1.0):
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, scale, s), jnp.float32), SHAPES,
                        is_leaf=lambda x: isinstance(x, tuple))


def numpy_clipped_adam(grads, lr, max_norm, b1, b2, eps):
    """Steps of clip-then-Adam in float64 over a list of gradient trees (flattened)."""
    flat = [np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(g)])
            for g in grads]
    mu = np.zeros_like(flat[0])
    nu = np.zeros_like(flat[0])
    steps = []
    for t, g in enumerate(flat, start=1):
        norm = np.sqrt(np.sum(g * g))
        g = g if norm < max_norm else g / norm * max_norm
        mu = b1 * mu + (1 - b1) * g
        nu = b2 * nu + (1 - b2) * g * g
        steps.append(-lr * (mu / (1 - b1 ** t)) / (np.sqrt(nu / (1 - b2 ** t)) + eps))
    return steps, mu, nu


@pytest.mark.parametrize("grad_scale", [0.05, 3.0])  # below and above the clip
def test_equals_optax_chain_and_a_float64_reference(grad_scale):
    rng = np.random.default_rng()
    lr, max_norm, eps = 3e-3, 1.0, 1e-6
    ours = clipped_adam(lr, max_norm, eps=eps)
    theirs = optax.chain(optax.clip_by_global_norm(max_norm), optax.adam(lr, eps=eps))
    params = random_tree(rng)
    ours_state, theirs_state = ours.init(params), theirs.init(params)
    update, reference = jax.jit(ours.update), jax.jit(theirs.update)
    grads = [random_tree(rng, grad_scale) for _ in range(5)]
    for g in grads:
        step, ours_state = update(g, ours_state, params)
        expected, theirs_state = reference(g, theirs_state, params)
        chex.assert_trees_all_close(step, expected, rtol=2e-6, atol=1e-9)
        chex.assert_trees_all_equal_shapes_and_dtypes(step, params)
    adam = theirs_state[1][0]
    assert int(ours_state.count) == int(adam.count) == len(grads)
    chex.assert_trees_all_close(ours_state.mu, adam.mu, rtol=2e-6, atol=1e-9)
    chex.assert_trees_all_close(ours_state.nu, adam.nu, rtol=2e-6, atol=1e-12)

    steps64, mu64, nu64 = numpy_clipped_adam(grads, lr, max_norm, 0.9, 0.999, eps)
    for got, want in ((step, steps64[-1]), (ours_state.mu, mu64), (ours_state.nu, nu64)):
        got = np.concatenate([np.ravel(x) for x in jax.tree.leaves(got)])
        # float32 against float64: a moment summed from gradients of both signs loses relative
        # accuracy as it nears zero, so the tolerance is relative to the largest element
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


def test_state_is_the_parameters_tree_and_independent_of_the_rate():
    params = random_tree(np.random.default_rng())
    state = clipped_adam(1e-3, 1.0).init(params)
    assert isinstance(state, ClippedAdamState)
    chex.assert_trees_all_equal_shapes_and_dtypes(state.mu, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(state.nu, params)
    assert state.count.shape == () and state.count.dtype == jnp.int32
    chex.assert_trees_all_equal(state, clipped_adam(0.5, 2.0).init(params))


def test_a_traced_rate_under_vmap_equals_each_member_alone():
    """A population traces the learning rate as a ``[P]`` array (agent/learner.make_optimizer)."""
    rng = np.random.default_rng()
    rates = np.asarray([1e-4, 3e-3, 2e-2], np.float32)
    params = jax.tree.map(lambda *x: jnp.stack(x), *[random_tree(rng) for _ in rates])
    grads = jax.tree.map(lambda *x: jnp.stack(x), *[random_tree(rng, 2.0) for _ in rates])

    def member(rate, g, p):
        opt = clipped_adam(rate, 1.0)
        return opt.update(g, opt.init(p), p)[0]

    together = jax.jit(jax.vmap(member))(jnp.asarray(rates), grads, params)
    for i, rate in enumerate(rates):
        pick = lambda tree: jax.tree.map(lambda x: x[i], tree)  # noqa: E731
        opt = clipped_adam(float(rate), 1.0)
        alone = opt.update(pick(grads), opt.init(pick(params)), pick(params))[0]
        chex.assert_trees_all_close(pick(together), alone, rtol=1e-6)
