"""Fused RND prediction error: the curiosity pass in one Pallas kernel.

An execution backend of :func:`foxhunt_jax.agent.curiosity.prediction_error` (same parameters,
same math, tested equal): for a block of rows, the target and the predictor network
(``D -> hidden -> hidden -> embed``, ReLU) and the summed squared difference of their
embeddings, ``obs [N, D] -> [N]``.

Why a kernel: XLA runs the pass as six f32 GEMMs whose ``[N, hidden]`` activations go through
HBM, about 5 KB a row against 160 B of input, and its f32 ``HIGHEST`` products run without
tensor cores. Here the activations stay on chip and each product is Triton's ``tf32x3`` (three
TF32 tensor-core products, about float32 accuracy: BENCHMARKS.md's curiosity precision table).
Interpreted off a CUDA GPU, the products are float32 ``HIGHEST``.

Shapes: ``N`` rows, ``D`` observation width, ``H`` hidden width, ``E`` embedding width; each is
zero-padded to a power of two of at least 16 (zero hidden units and embedding columns add
nothing to the error).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.q_forward import KernelConfig, block_rows_for, launch, on_cuda

LAYERS = ("hidden_0", "hidden_1", "out")
# f32 operands: 128 rows by 8 warps keeps the [128, H] activations in registers at H = 128
DEFAULT_CONFIG = KernelConfig(block_rows=128, num_warps=8, min_warps=4)


def _padded(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())


def pack_params(params: Any, widths: tuple[int, int, int]) -> list[jax.Array]:
    """One network's ``[kernel, bias]`` per layer, zero-padded to ``widths`` (D, H, E) padded;
    biases as ``[1, width]`` rows."""
    d, h, e = widths
    p = params["params"]
    shapes = {"hidden_0": (d, h), "hidden_1": (h, h), "out": (h, e)}
    out = []
    for name in LAYERS:
        w, b = p[name]["kernel"], p[name]["bias"]
        rows, cols = shapes[name]
        out.append(jnp.pad(w.astype(jnp.float32), ((0, rows - w.shape[0]), (0, cols - w.shape[1]))))
        out.append(jnp.pad(b.astype(jnp.float32), (0, cols - b.shape[0])).reshape(1, cols))
    return out


def _kernel(precision, x_ref, *refs):
    *weights, out_ref = refs
    x = x_ref[...]
    embeddings = []
    for net in range(2):  # target, then predictor
        h = x
        for layer in range(len(LAYERS)):
            w, b = weights[6 * net + 2 * layer][...], weights[6 * net + 2 * layer + 1][...]
            h = jnp.dot(h, w, precision=precision, preferred_element_type=jnp.float32) + b
            if layer < len(LAYERS) - 1:
                h = jnp.maximum(h, 0.0)
        embeddings.append(h)
    out_ref[...] = jnp.sum(jnp.square(embeddings[1] - embeddings[0]), axis=1)


def fused_prediction_error(predictor_params: Any, target_params: Any, obs: jax.Array, *,
                           config: KernelConfig | None = None,
                           interpret: bool | None = None) -> jax.Array:
    """Raw novelty ``||g(s) - f(s)||^2`` of every row: ``obs [N, D] -> [N] float32``.

    ``predictor_params``, ``target_params``: ``RNDNetwork`` parameter pytrees (``{"params":
    {...}}``). ``config``: launch shape (default ``DEFAULT_CONFIG``); ``interpret=None``
    interprets everywhere but on a CUDA GPU.
    """
    if obs.ndim != 2:
        raise ValueError(f"fused_prediction_error: obs must be [N, D], got shape {obs.shape}")
    config = config or DEFAULT_CONFIG
    p = target_params["params"]
    n, dim = obs.shape
    if p["hidden_0"]["kernel"].shape[0] != dim:
        raise ValueError(f"fused_prediction_error: obs width {dim} does not match the networks' "
                         f"input width {p['hidden_0']['kernel'].shape[0]}")
    widths = (_padded(dim), _padded(p["hidden_1"]["kernel"].shape[0]),
              _padded(p["out"]["kernel"].shape[1]))
    operands = pack_params(target_params, widths) + pack_params(predictor_params, widths)
    bm = block_rows_for(n, config)
    rows = -(-n // bm) * bm
    x = jnp.pad(jnp.asarray(obs, jnp.float32), ((0, rows - n), (0, widths[0] - dim)))
    interpret = (not on_cuda()) if interpret is None else interpret
    precision = jax.lax.Precision.HIGHEST if interpret else \
        jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3

    full = lambda a: pl.BlockSpec(a.shape, lambda i: (0, 0))  # noqa: E731
    in_specs = [pl.BlockSpec((bm, widths[0]), lambda i: (i, 0))] + [full(a) for a in operands]
    out = launch(functools.partial(_kernel, precision), "fused_rnd_error", config, bm,
                 rows // bm, in_specs, pl.BlockSpec((bm,), lambda i: (i,)),
                 jax.ShapeDtypeStruct((rows,), jnp.float32), interpret)(x, *operands)
    return out[:n]
