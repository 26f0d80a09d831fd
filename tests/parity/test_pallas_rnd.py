"""The curiosity-pass kernel (pallas_kernels/rnd.py) equals the Flax RND networks.

Interpret mode on the CPU, fresh random parameters and observations each run, against a float64
NumPy forward of both networks and against ``curiosity.prediction_error`` on XLA. The GPU
(Triton) build is checked by ``foxhunt-jax bench`` (forward section, curiosity rows).
"""

from __future__ import annotations

import dataclasses
import secrets
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax import backend as backends
from foxhunt_jax.agent import curiosity
from foxhunt_jax.agent.network import F32_PRECISION_MIN_ROWS
from foxhunt_jax.config import CuriosityConfig
from pallas_kernels import rnd, tuning
from test_curiosity import np_raw  # float64 forward of both RND networks

CFG = CuriosityConfig(hidden=128, embed=32, precision="bf16x3")
BACKENDS = {name: backends.make(name, tuning.for_device()) for name in backends.NAMES}
PALLAS = BACKENDS["pallas"]  # interpret mode off a CUDA GPU


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"numpy/jax seed {seed}")  # pytest shows it when the test fails
    return np.random.default_rng(seed)


def _state(rng, dim, cfg=CFG):
    """Fresh networks with non-zero biases (Flax starts them at zero, which would leave the
    kernel's bias path untested)."""
    state = curiosity.init(jax.random.key(int(rng.integers(2**31))), dim, cfg)
    jitter = lambda p: jax.tree.map(  # noqa: E731
        lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(np.float32), p)
    return state.replace(target_params=jitter(state.target_params),
                         predictor_params=jitter(state.predictor_params))


@pytest.mark.parametrize("dim,hidden,embed", [(40, 128, 32), (7, 48, 20), (33, 16, 3)])
def test_kernel_equals_float64_and_xla(rng, dim, hidden, embed):
    """Default and odd widths (every width padded): within bf16 x3 rounding of float64 and of
    XLA's pass, row by row."""
    cfg = dataclasses.replace(CFG, hidden=hidden, embed=embed)
    state = _state(rng, dim, cfg)
    n = F32_PRECISION_MIN_ROWS + int(rng.integers(0, 300))  # not a multiple of the block rows
    obs = jnp.asarray(2.0 * rng.standard_normal((n, dim)), jnp.float32)
    got = PALLAS.novelty(state, obs)
    chex.assert_shape(got, (n,))
    chex.assert_type(got, jnp.float32)
    assert _runs_kernel(PALLAS, state, n)
    ref = np_raw(state, np.asarray(obs))
    # three bf16 products keep ~16 mantissa bits of each operand: ~1e-5 of the embeddings
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=2e-4,
                               atol=1e-5 * float(np.max(ref)))
    xla = np.asarray(curiosity.prediction_error(state, obs), np.float64)
    assert np.max(np.abs(np.asarray(got) - xla)) / np.max(np.abs(xla)) < 1e-4


def test_split_bf16_keeps_sixteen_bits(rng):
    x = jnp.asarray(rng.standard_normal((64, 32)) * 10.0 ** rng.integers(-3, 4), jnp.float32)
    hi, lo = rnd.split_bf16(x)
    chex.assert_type([hi, lo], jnp.bfloat16)
    back = np.asarray(hi).astype(np.float64) + np.asarray(lo).astype(np.float64)
    x = np.asarray(x, np.float64)
    assert np.max(np.abs(back - x) / np.maximum(np.abs(x), 1e-30)) < 2.0 ** -15


def test_the_xla_split_has_the_same_bits_and_no_float_round_trip(rng):
    """The weights' split (run by XLA) equals the kernel's (round to nearest even, ties
    included) bit for bit, and holds no bfloat16 -> float32 conversion, the round trip XLA on
    a GPU may drop."""
    x = rng.standard_normal(4096) * 10.0 ** rng.integers(-6, 6, 4096)
    bits = np.asarray(x, np.float32).view(np.uint32)
    ties = (bits[:512] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exactly halfway
    x = jnp.asarray(np.concatenate([bits[512:], ties]).view(np.float32))
    for got, want in zip(jax.jit(rnd.split_bf16_xla)(x), rnd.split_bf16(x)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                      np.asarray(want).view(np.uint16))
    text = jax.jit(rnd.split_bf16_xla).lower(x).as_text()
    assert "bf16>) -> tensor<4096xf32>" not in text
    assert "bf16>) -> tensor<4096xf32>" in jax.jit(rnd.split_bf16).lower(x).as_text()


@pytest.mark.parametrize("backend,precision,rows,hidden,want", [
    ("pallas", "bf16x3", F32_PRECISION_MIN_ROWS, 128, True),
    ("xla", "bf16x3", F32_PRECISION_MIN_ROWS, 128, False),
    ("pallas", "float32", F32_PRECISION_MIN_ROWS, 128, False),  # bf16 x6: XLA's
    ("pallas", "bf16x3", F32_PRECISION_MIN_ROWS - 1, 128, False),  # true f32 below the bound
    ("pallas", "bf16x3", F32_PRECISION_MIN_ROWS, 512, False),  # wider than the kernel takes
])
def test_the_kernel_runs_only_where_it_computes_what_xla_would(backend, precision, rows, hidden,
                                                               want):
    cfg = dataclasses.replace(CFG, precision=precision, hidden=hidden)
    state = curiosity.init(jax.random.key(0), 12, cfg)
    assert _runs_kernel(BACKENDS[backend], state, rows) is want


def _runs_kernel(backend, state, rows: int) -> bool:
    """Whether ``backend.novelty`` of ``rows`` observations launches a Pallas kernel."""
    obs = jax.ShapeDtypeStruct((rows, state.target_params["params"]["hidden_0"]["kernel"].shape[0]),
                               jnp.float32)
    return "pallas_call" in str(jax.make_jaxpr(lambda o: backend.novelty(state, o))(obs))


def test_small_batches_stay_on_xla_in_true_f32(rng):
    """Below the bound the pallas backend gives XLA's own (true f32) numbers, bit for bit."""
    state = _state(rng, 12)
    obs = jnp.asarray(rng.standard_normal((100, 12)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(PALLAS.novelty(state, obs)),
                                  np.asarray(curiosity.prediction_error(state, obs)))


def test_kernel_under_vmap_equals_xla(rng):
    """The collector vmaps the pass over data-parallel shards (``collect_shards``)."""
    state = _state(rng, 11)
    obs = jnp.asarray(rng.standard_normal((2, F32_PRECISION_MIN_ROWS, 11)), jnp.float32)
    got = jax.vmap(lambda o: PALLAS.novelty(state, o))(obs)
    chex.assert_shape(got, (2, F32_PRECISION_MIN_ROWS))
    want = jax.vmap(lambda o: curiosity.prediction_error(state, o))(obs)
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 1e-4


def test_kernel_lowers_for_cuda_on_this_cpu():
    """Pallas -> Triton lowering at the default widths, alone and batched over shards, no GPU
    needed (the backend of a CUDA device, as :func:`pallas_kernels.tuning.for_device` reads
    it)."""
    gpu = backends.make("pallas", tuning.for_device(SimpleNamespace(platform="gpu",
                                                                    core_count=132)))
    state = curiosity.init(jax.random.key(0), 40, CFG)
    fn = jax.jit(lambda s, o: gpu.novelty(s, o))
    text = fn.trace(state, jnp.zeros((2048, 40), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text and "rnd_prediction_error" in text
    sharded = jax.jit(jax.vmap(lambda o: gpu.novelty(state, o)))
    assert "xla.gpu.triton" in sharded.trace(jnp.zeros((2, 2048, 40), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()


def test_kernel_rejects_stacked_observations():
    state = curiosity.init(jax.random.key(0), 5, CFG)
    with pytest.raises(ValueError, match=r"obs must be \[N, D\]"):
        rnd.prediction_error(state.target_params, state.predictor_params,
                             jnp.zeros((2, 3, 5), jnp.float32))
