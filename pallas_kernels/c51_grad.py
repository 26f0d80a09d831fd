"""Fused C51 gradient: the learner's forward, loss and backward in one Pallas kernel.

This is an execution backend of the learner's differentiated loss (``agent/learner.py``): the
value and parameter gradient of

    sum_m w_m * c51_cross_entropy(QNetwork.apply(params, obs), actions, targets)[m]

(:func:`foxhunt_jax.agent.loss.c51_cross_entropy`, the one definition of the loss), which XLA
computes as ~120 small kernels a learner step: the forward's GEMMs and their bias, ReLU and
conversion fusions, the selection of the taken actions, the log-softmax, and the transposed
GEMMs and reductions of the backward (BENCHMARKS.md, session 6). At a batch of 64 rows each of
those kernels is a link in a chain of launches, not arithmetic.

Here each program takes ``BM`` rows and

    runs the forward (``forward_rows`` of q_forward.py, the per-action layout), keeping each
        Dense layer's input chunks on chip;
    forms the loss of its rows and ``dL/dlogits`` of the taken actions:
        ``w / B * (softmax(logits[a]) * sum(m) - m)``;
    runs the backward layer by layer: ``dW = x^T dy``, ``db = sum_rows dy``, ``dx = dy W^T``,
        masked by the ReLU (``x > 0``);

and writes its rows' losses and its *partial* gradients (one slab per program), which XLA sums
over the programs outside the kernel (a float sum in a fixed order, so the result is
deterministic, unlike atomic adds).

The target distributions ``m`` (:func:`~foxhunt_jax.agent.loss.c51_targets`, from two
no-gradient forwards at the bootstrap observation) come in as an input: they do not depend on
the parameters being differentiated.

Precision follows the network's ``dtype``: bfloat16 GEMM inputs with float32 accumulation (the
backward casts ``dy`` to bfloat16 for its products, where XLA's autodiff rounds the products'
results to bfloat16 instead: errors of the same size, tested against float64), or true float32
products. Loss, softmax, bias and ReLU gradients are float32.

Shapes: ``M`` rows, ``D`` observation width, ``B`` branches, ``K`` atoms, ``G`` programs;
padded as in :mod:`pallas_kernels.q_forward`.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.q_forward import (_DTYPES, _Blocks, _offsets, _pad2, KernelConfig,
                                      forward_rows, launch, make_plan, operand_names,
                                      pack_params)

# 16 rows a program (four programs at the learner's batch of 64): the backward's weight
# gradients contract over the rows, and 16 is the smallest contraction Triton's dot accepts
DEFAULT_CONFIG = KernelConfig(block_rows=16, num_warps=4, min_warps=4, layout="per_action",
                              max_chunk=128)


def _dot(a, b, contract: tuple[int, int], cd):
    """``a`` and ``b`` contracted over one axis each, float32 result (true f32 for f32 inputs)."""
    precision = jax.lax.Precision.HIGHEST if cd == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)


def _kernel(plan, cd, x_ref, act_ref, w_ref, *refs):
    names = operand_names(plan)
    n_ops, nb = len(names), len(plan.branch_sizes)
    ops = dict(zip(names, refs[:n_ops]))
    m_refs = refs[n_ops:n_ops + nb]
    loss_ref = refs[n_ops + nb]
    grads = dict(zip(names, refs[n_ops + nb + 1:]))
    kp, k = plan.atoms_pad, plan.atoms
    blocks = _Blocks(ops, cd)

    inputs, logits = {}, {}
    sizes = plan.chunks(plan.obs_dim)
    xs = [x_ref[:, pl.ds(o, c)] for o, c in zip(_offsets(sizes), sizes)]
    forward_rows(plan, cd, "per_action", blocks, xs, None, on_logits=logits.__setitem__,
                 greedy=False, on_layer=inputs.__setitem__)

    # loss and dL/dlogits of the taken action, per branch ([BM, Kp]; zero past K)
    atom_ok = jax.lax.broadcasted_iota(jnp.int32, (1, kp), 1) < k
    w = w_ref[...][:, None] * jnp.float32(1.0 / nb)
    loss, g, taken = 0.0, [], []
    for d, n in enumerate(plan.branch_sizes):
        act = act_ref[:, d][:, None]
        taken.append(act)
        sel = logits[(d, 0)]
        for a in range(1, n):
            sel = jnp.where(act == a, logits[(d, a)], sel)
        sel = jnp.where(atom_ok, sel, -jnp.inf)
        shifted = sel - jnp.max(sel, axis=1, keepdims=True)
        e = jnp.exp(shifted)
        total = jnp.sum(e, axis=1, keepdims=True)
        m = m_refs[d][...]
        log_p = jnp.where(atom_ok, shifted - jnp.log(total), 0.0)
        loss = loss - jnp.sum(m * log_p, axis=1)
        g.append(w * (e / total * jnp.sum(m, axis=1, keepdims=True) - m))
    loss_ref[...] = loss * jnp.float32(1.0 / nb)

    def backward(name, dys, out_sizes, in_sizes, col0=0, need_dx=True):
        """Stores layer ``name``'s weight and bias gradients; returns ``dL/dx`` chunks."""
        dxs = [None] * len(in_sizes)
        for o, s, dy in zip(_offsets(out_sizes), out_sizes, dys):
            grads[name + "_b"][pl.ds(col0 + o, s)] = jnp.sum(dy, axis=0)
            dy = dy.astype(cd)
            for i, (r, c, x) in enumerate(zip(_offsets(in_sizes), in_sizes, inputs[name])):
                grads[name + "_w"][pl.ds(r, c), pl.ds(col0 + o, s)] = _dot(x, dy, (0, 0), cd)
                if need_dx:
                    dx = _dot(dy, blocks(name + "_w", (col0 + o, s), (r, c)), (1, 1), cd)
                    dxs[i] = dx if dxs[i] is None else dxs[i] + dx
        return dxs

    def relu_grad(dxs, name):  # the input of layer ``name`` is a ReLU output
        return [jnp.where(x > 0, dx, 0.0) for x, dx in zip(inputs[name], dxs)]

    def add(a, b):
        return [x + y for x, y in zip(a, b)]

    head_sizes = plan.chunks(plan.head)
    trunk_sizes = plan.chunks(plan.trunk[-1])
    # logits_d = v + adv_d - mean_a adv_d: dv = sum_d g_d, dadv_d[a] = [a == a_d] g_d - g_d / n_d
    dv = g[0]
    for gd in g[1:]:
        dv = dv + gd
    dh = backward("value_out", [dv], (kp,), head_sizes)
    dh = backward("value_hidden", relu_grad(dh, "value_out"), head_sizes, trunk_sizes)
    for d, n in enumerate(plan.branch_sizes):
        dha = None
        for a in range(n):
            da = jnp.where(taken[d] == a, g[d], 0.0) - g[d] * jnp.float32(1.0 / n)
            t = backward(f"adv{d}_out", [da], (kp,), head_sizes, col0=a * kp)
            dha = t if dha is None else add(dha, t)
        dh = add(dh, backward(f"adv{d}_hidden", relu_grad(dha, f"adv{d}_out"), head_sizes,
                              trunk_sizes))
    consumer = "value_hidden"  # every head layer reads the last trunk output
    for i in reversed(range(len(plan.trunk))):
        in_sizes = plan.chunks(plan.trunk[i - 1] if i else plan.obs_dim)
        dh = backward(f"trunk_{i}", relu_grad(dh, consumer), plan.chunks(plan.trunk[i]),
                      in_sizes, need_dx=i > 0)
        consumer = f"trunk_{i}"


def _unpack(grads: dict, plan, params: Any) -> Any:
    """Summed padded gradients -> the parameter pytree's structure and shapes."""
    p = params["params"] if "params" in params else params
    out = {}
    for name, layer in p.items():
        kernel, bias = grads[name + "_w"], grads[name + "_b"]
        fan_in, width = layer["kernel"].shape
        if name.startswith("adv") and name.endswith("_out"):  # [head_p, n_pad * Kp] blocks
            n, kp = width // plan.atoms, plan.atoms_pad
            kernel = kernel.reshape(kernel.shape[0], -1, kp)[:, :n, :plan.atoms]
            bias = bias.reshape(-1, kp)[:n, :plan.atoms]
            kernel, bias = kernel.reshape(kernel.shape[0], width), bias.reshape(width)
        out[name] = {"kernel": kernel[:fan_in, :width], "bias": bias[:width]}
    return {"params": out} if "params" in params else out


def fused_c51_grad(params: Any, obs: jax.Array, actions: jax.Array,
                   targets: Sequence[jax.Array], weights: jax.Array, network, *,
                   config: KernelConfig | None = None, interpret: bool | None = None):
    """Per-sample C51 loss and the gradient of its weighted sum, in one fused kernel.

    Args:
      params: the ``QNetwork`` parameter pytree (``{"params": {...}}`` as ``init`` returns).
      obs: ``[M, D]`` observations at s.
      actions: ``[M, B]`` int32 actions taken at s.
      targets: tuple over branches of ``[M, K]`` target distributions
        (:func:`foxhunt_jax.agent.loss.c51_targets`).
      weights: ``[M]`` float32 weight of each row's loss in the differentiated sum.
      network: the ``QNetwork`` (its static fields define the layout and the GEMM dtype).
      config: launch shape (default :data:`DEFAULT_CONFIG`; only ``block_rows``, the warps,
        stages and ``max_chunk`` matter); ``interpret=None`` interprets off a CUDA GPU.
    Returns:
      ``(losses [M] float32, grads)``: ``losses`` is
      ``c51_cross_entropy(network.apply(params, obs), actions, targets)``, ``grads`` the
      gradient of ``sum(weights * losses)`` with respect to ``params`` (same pytree).
    """
    config = config or DEFAULT_CONFIG
    m, dim = obs.shape
    nb = len(network.branch_sizes)
    plan = make_plan(network, dim, config.max_chunk)
    cd = _DTYPES[network.dtype]
    bm = config.block_rows
    rows = -(-m // bm) * bm
    grid = rows // bm
    kp = plan.atoms_pad
    x = _pad2(jnp.asarray(obs, jnp.float32), rows, plan.padded(dim)).astype(cd)
    act = jnp.pad(jnp.asarray(actions, jnp.int32), ((0, rows - m), (0, 0)))
    w = jnp.pad(jnp.asarray(weights, jnp.float32), (0, rows - m))  # padded rows weigh 0
    ms = [_pad2(jnp.asarray(t, jnp.float32), rows, kp) for t in targets]
    packed = pack_params(params, plan, network.dtype)
    operands = [packed[k] for k in operand_names(plan)]

    full = lambda a: pl.BlockSpec(a.shape, lambda i, _nd=a.ndim: (0,) * _nd)
    in_specs = ([pl.BlockSpec((bm, x.shape[1]), lambda i: (i, 0)),
                 pl.BlockSpec((bm, nb), lambda i: (i, 0)), pl.BlockSpec((bm,), lambda i: (i,))]
                + [full(a) for a in operands] + [pl.BlockSpec((bm, kp), lambda i: (i, 0))] * nb)
    out_shape = [jax.ShapeDtypeStruct((rows,), jnp.float32)]
    out_specs = [pl.BlockSpec((bm,), lambda i: (i,))]
    for a in operands:  # one partial gradient per program, summed below
        out_shape.append(jax.ShapeDtypeStruct((grid,) + a.shape, jnp.float32))
        out_specs.append(pl.BlockSpec((None,) + a.shape,
                                      lambda i, _nd=a.ndim: (i,) + (0,) * _nd))
    kernel = functools.partial(_kernel, plan, cd)
    outs = launch(kernel, "fused_c51_grad", config, bm, grid, in_specs, tuple(out_specs),
                  tuple(out_shape), interpret)(x, act, w, *operands, *ms)
    summed = {k: jnp.sum(g, axis=0) for k, g in zip(operand_names(plan), outs[1:])}
    return outs[0][:m], _unpack(summed, plan, params)


__all__ = ["fused_c51_grad", "DEFAULT_CONFIG"]
