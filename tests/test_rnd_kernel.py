"""The RND kernels (pallas_kernels/rnd.py) equal the Flax curiosity networks.

Run in Pallas' interpret mode on the CPU, on fresh random parameters, widths and observations,
against JAX's autodiff of the Flax networks and an independent float64 NumPy forward and
backward pass. The Triton build is lowered here for CUDA and timed on the GPU by
``scripts/explore_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import secrets

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.agent import curiosity
from foxhunt_jax.config import CuriosityConfig
from pallas_kernels import q_forward as qf
from pallas_kernels import rnd as rnd_kernel


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"numpy/jax seed {seed}")  # pytest shows it when the test fails
    return np.random.default_rng(seed)


def _state(rng, dim, hidden, embed, near=False):
    """An RND state with random parameters; ``near``: a predictor within 1 % of the target,
    as late in a run (the novelty is then a small difference of two embeddings)."""
    cfg = CuriosityConfig(coef=0.1, hidden=hidden, embed=embed)
    state = curiosity.init(jax.random.key(int(rng.integers(1 << 31))), dim, cfg)
    if near:
        noise = lambda t: t * (1 + 0.01 * rng.standard_normal(t.shape))  # noqa: E731
        state = state.replace(predictor_params=jax.tree.map(
            lambda t: jnp.asarray(noise(np.asarray(t)), jnp.float32), state.target_params))
    return state


def _np_params(params):
    p = params["params"]
    return [(np.asarray(p[n]["kernel"], np.float64), np.asarray(p[n]["bias"], np.float64))
            for n in rnd_kernel.LAYERS]


def np_loss_and_grad(predictor, target, x):
    """float64 MSE of the embeddings over [M, E] and its gradient, by hand."""
    def forward(params):
        (w1, b1), (w2, b2), (w3, b3) = _np_params(params)
        h1 = np.maximum(x @ w1 + b1, 0)
        h2 = np.maximum(h1 @ w2 + b2, 0)
        return h1, h2, h2 @ w3 + b3

    x = np.asarray(x, np.float64)
    (_, (w2, _), (w3, _)) = _np_params(predictor)
    h1, h2, y = forward(predictor)
    diff = y - forward(target)[2]
    dy = 2 * diff / diff.size
    dz2 = (dy @ w3.T) * (h2 > 0)
    dz1 = (dz2 @ w2.T) * (h1 > 0)
    grads = [(x.T @ dz1, dz1.sum(0)), (h1.T @ dz2, dz2.sum(0)), (h2.T @ dy, dy.sum(0))]
    return np.mean(diff ** 2), np.sum(diff ** 2, -1), grads


def _assert_grads_close(got, want, rtol):
    for name, (gw, gb) in zip(rnd_kernel.LAYERS, want):
        for key, ref in (("kernel", gw), ("bias", gb)):
            value = np.asarray(got["params"][name][key], np.float64)
            chex.assert_shape(value, ref.shape)
            scale = np.max(np.abs(ref)) + 1e-30
            assert np.max(np.abs(value - ref)) <= rtol * scale, (name, key)


@pytest.mark.parametrize("m,dim,hidden,embed", [(64, 40, 128, 32), (50, 9, 24, 5),
                                                (1, 3, 16, 16)])
def test_loss_and_grad_equal_float64_and_autodiff(rng, m, dim, hidden, embed):
    """Any batch size (padded rows masked out), widths that are not powers of two, a fresh and
    a nearly trained predictor."""
    kernel = jax.jit(rnd_kernel.loss_and_grad)
    for near in (False, True):
        state = _state(rng, dim, hidden, embed, near)
        x = jnp.asarray(rng.standard_normal((m, dim)) * rng.uniform(0.5, 3), jnp.float32)
        loss, grads = kernel(state.predictor_params, state.target_params, x)
        chex.assert_shape(loss, ())
        chex.assert_type(loss, jnp.float32)
        chex.assert_trees_all_equal_shapes_and_dtypes(grads, state.predictor_params)
        want_loss, _, want_grads = np_loss_and_grad(state.predictor_params,
                                                    state.target_params, x)
        np.testing.assert_allclose(float(loss), want_loss, rtol=2e-5)
        _assert_grads_close(grads, want_grads, 2e-5)
        # and JAX's autodiff of the Flax networks, the default backend
        ad_loss, ad_grads = curiosity.loss_and_grad(state, x)
        np.testing.assert_allclose(float(loss), float(ad_loss), rtol=1e-5)
        chex.assert_trees_all_close(grads, ad_grads, rtol=1e-4,
                                    atol=1e-6 * max(float(jnp.max(jnp.abs(g)))
                                                    for g in jax.tree.leaves(ad_grads)))


@pytest.mark.parametrize("n,block_rows", [(300, 128), (5, 16), (1024, 64)])
def test_errors_equal_float64(rng, n, block_rows):
    """The raw novelty over row blocks, the last one padded; a fresh and a nearly trained
    predictor."""
    dim = int(rng.integers(3, 48))
    cfg = dataclasses.replace(rnd_kernel.ERRORS_CONFIG, block_rows=block_rows)
    kernel = jax.jit(lambda p, t, x: rnd_kernel.errors(p, t, x, config=cfg))
    for near in (False, True):
        state = _state(rng, dim, 32, 8, near)
        x = jnp.asarray(rng.standard_normal((n, dim)), jnp.float32)
        got = kernel(state.predictor_params, state.target_params, x)
        chex.assert_shape(got, (n,))
        chex.assert_type(got, jnp.float32)
        want = np_loss_and_grad(state.predictor_params, state.target_params, np.asarray(x))[1]
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4,
                                   atol=1e-6 * np.max(want))


def test_update_backends_agree_over_steps(rng):
    """Ten Adam steps of the predictor with the kernel's gradient follow the Flax autodiff's."""
    state = _state(rng, 40, 128, 32)
    batches = jnp.asarray(rng.standard_normal((10, 64, 40)), jnp.float32)

    def run(backend):
        return jax.jit(lambda s: jax.lax.scan(lambda c, b: curiosity.update(c, b, backend), s,
                                              batches))(state)

    (a, loss_a), (b, loss_b) = run("xla"), run("pallas")
    np.testing.assert_allclose(np.asarray(loss_b), np.asarray(loss_a), rtol=1e-5)
    chex.assert_trees_all_close(b.predictor_params, a.predictor_params, atol=1e-6)
    chex.assert_trees_all_equal(b.target_params, state.target_params)


def test_kernels_lower_for_cuda_on_this_cpu(monkeypatch):
    """Pallas -> Triton lowering of both kernels (bf16 x6 products, transposed operands) at the
    default widths, no GPU needed."""
    monkeypatch.setattr(qf, "on_cuda", lambda: True)
    state = curiosity.init(jax.random.key(0), 40, CuriosityConfig())
    obs = jnp.zeros((64, 40), jnp.float32)
    for fn, name in ((rnd_kernel.loss_and_grad, "rnd_loss_and_grad"),
                     (rnd_kernel.errors, "rnd_errors")):
        # a fresh function: jit's trace cache does not see the patched platform check
        text = jax.jit(lambda p, t, o, _f=fn: _f(p, t, o)).trace(
            state.predictor_params, state.target_params, obs).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text and name in text
