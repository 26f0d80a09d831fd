"""RND curiosity networks in Pallas kernels: the predictor's loss and gradient in one program.

This is an execution backend of :mod:`foxhunt_jax.agent.curiosity` (the Flax ``RNDNetwork`` is
the one definition): the same parameter pytrees and the same math,

    f(x), g(x) = the target's and predictor's MLP  D -> H (ReLU) -> H (ReLU) -> E
    e = sum((g(x) - f(x))^2, axis=-1)                       (raw novelty, per row)
    loss = mean over the M x E squared differences, and its gradient for g's parameters

:func:`loss_and_grad` is what the learner step's predictor update needs. XLA runs that update
as about 26 small kernels per learner step (forwards, the loss, the transposed products of the
backward and their reductions); at the seed's batch of 64 they cost a step 14-18 us although
nothing else in the step waits on them, since a step's CUDA graph pays for every kernel it holds
(BENCHMARKS.md, session 9). Here one program holds the whole batch, the activations and the
backward: the kernel count of the update drops to this one launch plus the optimizer's.
:func:`errors` is the forward alone over blocks of rows (the curiosity pass).

Products use bf16 x6 (``BF16_BF16_F32_X6``: each f32 operand split into three bf16 parts, six
tensor-core products, f32 accumulation), as accurate against float64 as true f32 products
(BENCHMARKS.md, session 8); :data:`PRECISION` names it. Elsewhere than on a CUDA GPU the
kernels run in Pallas' interpret mode (for the tests).

Widths are zero-padded to powers of two of at least 16 (Triton's dot): zero weights and biases
add exact zeros, and padded rows of a batch are masked out of the loss.

Shapes: ``M`` rows, ``D`` observation width, ``H`` hidden width, ``E`` embedding width; padded
``Mp``, ``Dp``, ``Hp``, ``Ep``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jax.experimental import pallas as pl

from pallas_kernels.q_forward import KernelConfig, launch

PRECISION = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6
LAYERS = ("hidden_0", "hidden_1", "out")
_MIN = 16  # Triton's smallest dot dimension
# one program, the whole batch; 4 warps: the products are a few tiles each
GRAD_CONFIG = KernelConfig(block_rows=64, num_warps=4, min_warps=4)
# the forward over row blocks (the curiosity pass)
ERRORS_CONFIG = KernelConfig(block_rows=128, num_warps=8, min_warps=4)


def _pad_width(n: int) -> int:
    return max(_MIN, 1 << (int(n) - 1).bit_length())


def pack(params: Any) -> list[jax.Array]:
    """``RNDNetwork`` parameters -> ``[w1 [Dp, Hp], b1 [Hp], w2, b2, w3 [Hp, Ep], b3]`` float32,
    zero-padded."""
    p = params["params"] if "params" in params else params
    out = []
    for name in LAYERS:
        w = jnp.asarray(p[name]["kernel"], jnp.float32)
        b = jnp.asarray(p[name]["bias"], jnp.float32)
        rows, cols = _pad_width(w.shape[0]), _pad_width(w.shape[1])
        out += [jnp.pad(w, ((0, rows - w.shape[0]), (0, cols - w.shape[1]))),
                jnp.pad(b, (0, cols - b.shape[0]))]
    return out


def _dot(a, b, contract=(1, 0)):
    """``a`` times ``b`` over axes ``contract`` (of a, of b), bf16 x6, f32 result."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=PRECISION,
                               preferred_element_type=jnp.float32)


def _forward(x, w):
    """The MLP on a block ``x [Mp, Dp]``: ``(h1, h2, y)`` (both hidden layers after ReLU)."""
    h1 = jnp.maximum(_dot(x, w[0]) + w[1][None, :], 0.0)
    h2 = jnp.maximum(_dot(h1, w[2]) + w[3][None, :], 0.0)
    return h1, h2, _dot(h2, w[4]) + w[5][None, :]


def _errors_kernel(x_ref, *refs):
    """Inputs: a row block, the target's six operands, the predictor's. Output: ``e [BM]``."""
    target = [r[...] for r in refs[:6]]
    predictor = [r[...] for r in refs[6:12]]
    x = x_ref[...]
    y_t = _forward(x, target)[2]
    y_p = _forward(x, predictor)[2]
    refs[12][...] = jnp.sum(jnp.square(y_p - y_t), axis=1)


def _grad_kernel(rows: int, scale: float, x_ref, *refs):
    """One program: the batch's per-row errors ``[Mp]`` (zero on padded rows) and the gradient
    of ``scale * sum of squared differences`` for the predictor's six operands."""
    target = [r[...] for r in refs[:6]]
    w = [r[...] for r in refs[6:12]]
    err_ref, grad_refs = refs[12], refs[13:19]
    x = x_ref[...]
    y_t = _forward(x, target)[2]
    h1, h2, y = _forward(x, w)
    real = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0) < rows
    diff = jnp.where(real, y - y_t, 0.0)
    err_ref[...] = jnp.sum(diff * diff, axis=1)
    dy = diff * jnp.float32(2.0 * scale)  # d loss / d y  [Mp, Ep]
    dz2 = jnp.where(h2 > 0, _dot(dy, w[4], (1, 1)), 0.0)  # back through out and ReLU  [Mp, Hp]
    dz1 = jnp.where(h1 > 0, _dot(dz2, w[2], (1, 1)), 0.0)
    grads = (_dot(x, dz1, (0, 0)), jnp.sum(dz1, axis=0),
             _dot(h1, dz2, (0, 0)), jnp.sum(dz2, axis=0),
             _dot(h2, dy, (0, 0)), jnp.sum(dy, axis=0))
    for ref, g in zip(grad_refs, grads):
        ref[...] = g


def _full(a):
    return pl.BlockSpec(a.shape, lambda i, _nd=a.ndim: (0,) * _nd)


def _padded_obs(obs: jax.Array, rows: int, dp: int) -> jax.Array:
    obs = jnp.asarray(obs, jnp.float32)
    return jnp.pad(obs, ((0, rows - obs.shape[0]), (0, dp - obs.shape[1])))


def loss_and_grad(predictor_params: Any, target_params: Any, obs: jax.Array, *,
                  config: KernelConfig | None = None, interpret: bool | None = None):
    """``jax.value_and_grad`` of the predictor loss ``mean((g(obs) - f(obs))^2)`` in one kernel.

    Args:
      predictor_params, target_params: ``RNDNetwork`` parameter pytrees (``{"params": ...}``).
      obs: ``[M, D]`` observations (the target is a constant: no gradient flows into it).
    Returns:
      ``(loss, grads)``: the float32 scalar loss and a pytree like ``predictor_params``.
    """
    config = config or GRAD_CONFIG
    m = obs.shape[0]
    target, predictor = pack(target_params), pack(predictor_params)
    mp = _pad_width(m)
    x = _padded_obs(obs, mp, target[0].shape[0])
    p = predictor_params["params"] if "params" in predictor_params else predictor_params
    e = p["out"]["bias"].shape[0]
    inputs = [x] + target + predictor
    out_shape = (jax.ShapeDtypeStruct((mp,), jnp.float32),) + tuple(
        jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in predictor)
    kernel = functools.partial(_grad_kernel, m, 1.0 / (m * e))
    err, *packed = launch(kernel, "rnd_loss_and_grad", config, mp, 1,
                          [_full(a) for a in inputs], tuple(_full(a) for a in out_shape),
                          out_shape, interpret)(*inputs)
    grads = {}
    for i, name in enumerate(LAYERS):
        w, b = p[name]["kernel"], p[name]["bias"]
        grads[name] = {"kernel": packed[2 * i][:w.shape[0], :w.shape[1]],
                       "bias": packed[2 * i + 1][:b.shape[0]]}
    grads = {"params": grads} if "params" in predictor_params else grads
    return jnp.sum(err) * jnp.float32(1.0 / (m * e)), grads


def errors(predictor_params: Any, target_params: Any, obs: jax.Array, *,
           config: KernelConfig | None = None, interpret: bool | None = None) -> jax.Array:
    """Raw novelty ``sum((g(obs) - f(obs))^2, -1)``: ``obs [N, D] -> [N] float32``, one program
    per ``config.block_rows`` rows."""
    config = config or ERRORS_CONFIG
    n = obs.shape[0]
    target, predictor = pack(target_params), pack(predictor_params)
    bm = min(config.block_rows, _pad_width(n))
    rows = -(-n // bm) * bm
    x = _padded_obs(obs, rows, target[0].shape[0])
    operands = target + predictor
    specs = [pl.BlockSpec((bm, x.shape[1]), lambda i: (i, 0))] + [_full(a) for a in operands]
    out = launch(_errors_kernel, "rnd_errors", config, bm, rows // bm, specs,
                 pl.BlockSpec((bm,), lambda i: (i,)),
                 jax.ShapeDtypeStruct((rows,), jnp.float32), interpret)(x, *operands)
    return out[:n]


__all__ = ["loss_and_grad", "errors", "pack", "PRECISION", "GRAD_CONFIG", "ERRORS_CONFIG"]
