"""The curiosity pass in one kernel: both RND networks and the squared error of each row.

An execution backend of :func:`foxhunt_jax.agent.curiosity.prediction_error` (the Flax
``RNDNetwork``, ``D -> hidden -> hidden -> embed``), for the precision a bfloat16 run gives the
pass over collected observations: every float32 GEMM as three bf16 products with float32
accumulation (``curiosity.precision="bf16x3"``, XLA's ``BF16_BF16_F32_X3``). XLA runs the pass
as one GEMM kernel per layer and network, each writing its ``[rows, hidden]`` activations to
memory and reading them back; here a program takes ``BM`` rows through both networks with the
activations in registers and writes one float a row, ``||g(s) - f(s)||^2``.

Each operand ``a`` is split as ``hi = bf16(a)``, ``lo = bf16(a - hi)``, and a product ``a @ w``
is ``hi @ w_hi + hi @ w_lo + lo @ w_hi`` (the ``lo @ w_lo`` term, about 2^-16 of the product,
is dropped, as XLA's algorithm drops it). The weights are split once a call, outside the kernel
(:func:`split_bf16_xla`), the activations inside it (:func:`split_bf16`).

Widths are zero-padded: the observation to 16-aligned power-of-two pieces (the smallest GEMM
block Triton's tensor-core dot takes), hidden and embedding widths to a power of two. Zero
weight rows and columns and zero biases leave every real output unchanged (ReLU(0) = 0, and a
padded embedding column is 0 in both networks).

Shapes: ``N`` observations, ``D`` observation width, ``H`` hidden width, ``E`` embedding width.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.q_forward import ALIGN, chunks, launch, offsets_of
from pallas_kernels.tuning import KernelConfig, block_rows_for, for_device, next_pow2

_LAYERS = ("hidden_0", "hidden_1", "out")
# Widest hidden or embedding width the kernel takes: a [BM, W] float32 accumulator and its two
# bf16 halves stay in registers at BM = 128 up to W = 256.
MAX_WIDTH = 256


def _pow2(n: int) -> int:
    """A hidden or embedding width padded: a power of two, at least Triton's smallest dot."""
    return max(ALIGN, next_pow2(n))


def supports(hidden: int, embed: int) -> bool:
    """Whether the kernel takes an RND network of these widths (:data:`MAX_WIDTH`)."""
    return _pow2(hidden) <= MAX_WIDTH and _pow2(embed) <= MAX_WIDTH


def split_bf16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x`` float32 -> ``(hi, lo)`` bfloat16 with ``hi + lo`` equal to ``x`` to ~16 bits: ``hi``
    is ``x`` rounded to nearest (even), ``lo`` the rest, rounded. For use inside the kernel;
    outside it, in an XLA program, use :func:`split_bf16_xla`."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def split_bf16_xla(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`split_bf16`, the same bits for finite ``x``, written so that an XLA program keeps
    it. XLA on a GPU may drop a float32 -> bfloat16 -> float32 round trip
    (``xla_allow_excess_precision``, on by default), which makes :func:`split_bf16`'s ``lo``
    zero there (the kernel's weights would then multiply as one bf16 product). Here ``hi`` is
    rounded with integer operations on the bits (to nearest, ties to even), which no float
    simplification removes."""
    bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
    odd = (bits >> 16) & jnp.uint32(1)
    hi = jax.lax.bitcast_convert_type((bits + jnp.uint32(0x7FFF) + odd) & jnp.uint32(0xFFFF0000),
                                      jnp.float32)
    return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def _pack(params: Any, d_pad: int) -> list[jax.Array]:
    """One network's Flax params -> ``[w_hi, w_lo, b]`` per layer, zero-padded: ``w [in_p,
    out_p]`` bfloat16 halves of the float32 kernel (:func:`split_bf16_xla`), ``b [out_p]``
    float32."""
    p = params["params"]
    out, rows = [], d_pad
    for name in _LAYERS:
        w, b = p[name]["kernel"], p[name]["bias"]
        cols = _pow2(w.shape[1])
        w = jnp.pad(jnp.asarray(w, jnp.float32), ((0, rows - w.shape[0]), (0, cols - w.shape[1])))
        out += [*split_bf16_xla(w), jnp.pad(jnp.asarray(b, jnp.float32), (0, cols - b.shape[0]))]
        rows = cols
    return out


def _dot3(xs: list, ws: list) -> jax.Array:
    """``sum_k x_k @ w_k`` over K pieces, each as three bf16 products: ``xs`` the ``(hi, lo)``
    activation pieces ``[BM, c]``, ``ws`` the matching ``(hi, lo)`` weight pieces ``[c, W]``."""
    acc = None
    for (xh, xl), (wh, wl) in zip(xs, ws):
        for a, b in ((xh, wh), (xh, wl), (xl, wh)):
            prod = jnp.dot(a, b, preferred_element_type=jnp.float32)
            acc = prod if acc is None else acc + prod
    return acc


def _embed(x_pieces: list, spans: list[tuple[int, int]], refs) -> jax.Array:
    """One network's ``[BM, E_p]`` float32 embedding of the observation's ``(hi, lo)`` pieces
    (``spans``: their ``(offset, width)``); ``refs`` the network's nine packed operands."""
    xs = x_pieces
    for layer in range(3):
        wh_ref, wl_ref, b_ref = refs[3 * layer:3 * layer + 3]
        if layer == 0:  # the observation arrives in pieces; so do the first weights' rows
            ws = [(wh_ref[pl.ds(o, c), :], wl_ref[pl.ds(o, c), :]) for o, c in spans]
        else:
            ws = [(wh_ref[...], wl_ref[...])]
        y = _dot3(xs, ws) + b_ref[...][None, :]
        if layer == 2:
            return y
        xs = [split_bf16(jnp.maximum(y, 0.0))]


def _kernel(pieces: tuple[int, ...], x_ref, *refs):
    """``x_ref [BM, D_p]`` float32, the target's then the predictor's packed operands, then the
    output ``[BM]``: each row's summed squared embedding difference."""
    spans = list(zip(offsets_of(pieces), pieces))
    x_pieces = [split_bf16(x_ref[:, pl.ds(o, c)]) for o, c in spans]
    target = _embed(x_pieces, spans, refs[:9])
    predicted = _embed(x_pieces, spans, refs[9:18])
    diff = predicted - target
    refs[18][...] = jnp.sum(diff * diff, axis=1)


def prediction_error(target_params: Any, predictor_params: Any, obs: jax.Array, *,
                     config: KernelConfig | None = None,
                     interpret: bool | None = None) -> jax.Array:
    """``||g(s) - f(s)||^2`` of each row: ``obs [N, D]`` -> ``[N]`` float32, the GEMMs as three
    bf16 products (see the module docstring). ``target_params``/``predictor_params``: Flax
    params of ``RNDNetwork`` (``{"params": {"hidden_0", "hidden_1", "out"}}``). ``config``,
    ``interpret``: launch shape and mode (default: the tuning table's for the default device,
    :mod:`pallas_kernels.tuning`)."""
    if obs.ndim != 2:
        raise ValueError(f"rnd kernel: obs must be [N, D], got shape {obs.shape}")
    config = for_device().rnd if config is None else config
    n, d = obs.shape
    pieces = chunks(d)
    d_pad = sum(pieces)
    bm = block_rows_for(n, config)
    rows = -(-n // bm) * bm
    x = jnp.pad(jnp.asarray(obs, jnp.float32), ((0, rows - n), (0, d_pad - d)))
    operands = _pack(target_params, d_pad) + _pack(predictor_params, d_pad)
    full = lambda a: pl.BlockSpec(a.shape, lambda i, _nd=a.ndim: (0,) * _nd)  # noqa: E731
    in_specs = [pl.BlockSpec((bm, d_pad), lambda i: (i, 0))] + [full(a) for a in operands]
    out = launch(functools.partial(_kernel, pieces), "rnd_prediction_error", config, bm,
                 rows // bm, in_specs, pl.BlockSpec((bm,), lambda i: (i,)),
                 jax.ShapeDtypeStruct((rows,), jnp.float32), interpret)(x, *operands)
    return out[:n]
