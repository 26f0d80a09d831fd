"""Fused Q-forward: one Pallas kernel from observations to per-branch greedy actions.

This is an execution backend of :class:`foxhunt_jax.agent.network.QNetwork` (the one definition
of the network) for collection and inference: the same parameter pytree and the same math,

    obs -> trunk (ReLU) -> value / advantage streams -> dueling in logit space
        -> softmax over atoms -> expected Q per action -> per-branch argmax,

but in a single Triton-lowered ``pallas_call``. Each program takes a block of ``BM`` rows and
keeps every activation on chip across the ten GEMMs and the atom softmax; only the observations
come in from device memory and only the actions (and optionally the expected Q) go out. XLA's
version writes and re-reads every intermediate activation between its GEMM and fusion kernels.

:func:`fused_logits` is the same kernel stopping at the dueling logits (``network.apply``'s
output). Given an action per branch and row it writes only those actions' logits, which is
what the initial priorities and the validation loss read (``taken_logits``).
:func:`fused_act` is the collection forward: greedy actions and the logits of the action taken
under given explore draws. :func:`fused_bootstrap_loss` goes on from the bootstrap actions'
logits to the C51 loss (:func:`c51_rows`: softmax, projection, cross-entropy with given online
logits) and writes one float a row, where XLA writes the logits and runs the loss as kernels of
their own.

The weights stream from device memory (L2) through each program once per block of rows. The
kernel reads them through :class:`_Blocks`, which can issue each block's load a few blocks
before the product that uses it (``KernelConfig.lookahead``), since Triton emits a load where
the program has it.

Triton needs power-of-two tensor sizes, while the network's widths are not (observation 40,
heads 160, 11 atoms, 5 or 3 actions). So, outside the kernel, :func:`pack_params` zero-pads the
parameters once per call (XLA hoists it out of a scan): every width is rounded up to a multiple
of 16 and then split into power-of-two *chunks* (160 = 128 + 32), which the kernel multiplies
block by block; atoms are padded to ``Kp`` and actions to ``n_pad`` (both powers of two) and
masked inside the kernel. Zero rows and columns add exact zeros, so padding does not change the
result beyond float re-association.

Two layouts of the advantage output exist, both tested equal to the Flax forward:
``"grouped"`` multiplies each branch's hidden state by its whole output matrix at once and
reshapes ``[BM, n_pad * Kp] -> [BM, n_pad, Kp]``; ``"per_action"`` does one small GEMM per
action and stays two-dimensional. Which one is faster is measured (``foxhunt-jax bench``).

Precision: ``dtype="bfloat16"`` casts observations and weights to bfloat16 and accumulates in
float32, as the Flax layers do; ``dtype="float32"`` multiplies in true float32 (Triton's IEEE
dot, matching the Flax layers' ``Precision.HIGHEST``). Bias adds, dueling, softmax and the
expected value are float32 in both. The config offers ``network.backend=pallas`` with bfloat16
only, where the kernel is faster than XLA; the float32 kernel, slower than XLA's GEMMs, is kept
for the equality tests and the benchmark.

Launch shapes come from :mod:`pallas_kernels.tuning`; where it says the device does not compile
Triton the kernel runs in Pallas' interpret mode (the tests use it on the CPU; it is slow and
meant for checking, not for training).

Shapes: ``N`` rows, ``D`` observation width, ``B`` branches, ``n_d`` actions of branch d, ``K``
atoms; padded: ``Dp``, ``Kp``, ``n_pad``; ``BM`` rows per program.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.tuning import MAX_CHUNK, KernelConfig, block_rows_for, for_device, next_pow2

ALIGN = 16  # smallest GEMM dimension Triton's tensor-core dot accepts
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
LAYOUTS = ("grouped", "per_action")


def apply_draws(draws: jax.Array, greedy: jax.Array) -> jax.Array:
    """Epsilon-greedy actions ``[..., B]`` from explore draws ``[..., B]`` int32 (-1 where a
    branch keeps its greedy action, else the random action it takes) and greedy actions
    ``[..., B]``. Pure jnp, so the kernels and the agent's collection forward share it."""
    return jnp.where(draws >= 0, draws, greedy)


def chunks(width: int, max_chunk: int = 256) -> tuple[int, ...]:
    """Power-of-two pieces (each >= 16 and <= ``max_chunk``) summing to ``width`` rounded up
    to 16. ``chunks(160) == (128, 32)``, ``chunks(40) == (32, 16)``, ``chunks(256) == (256,)``,
    ``chunks(256, 128) == (128, 128)``.
    """
    rest = -(-int(width) // ALIGN) * ALIGN
    out = []
    while rest > 0:
        piece = min(max_chunk, 1 << (rest.bit_length() - 1))
        out.append(piece)
        rest -= piece
    return tuple(out)


def offsets_of(sizes: Sequence[int]) -> tuple[int, ...]:
    """Where each of consecutive pieces of ``sizes`` starts: ``(0, s0, s0 + s1, ...)``."""
    return tuple(int(x) for x in np.cumsum((0,) + tuple(sizes))[:-1])


@dataclass(frozen=True)
class Plan:
    """Static layout of one network for the kernel (hashable; decided from shapes only)."""

    obs_dim: int
    trunk: tuple[int, ...]
    head: int
    atoms: int
    branch_sizes: tuple[int, ...]
    max_chunk: int = 256

    def chunks(self, width: int) -> tuple[int, ...]:
        return chunks(width, self.max_chunk)

    @property
    def atoms_pad(self) -> int:
        return max(ALIGN, next_pow2(self.atoms))

    def actions_pad(self, d: int) -> int:
        return next_pow2(self.branch_sizes[d])

    @property
    def q_offsets(self) -> tuple[int, ...]:
        return offsets_of([self.actions_pad(d) for d in range(len(self.branch_sizes))])

    @property
    def q_width(self) -> int:
        return sum(self.actions_pad(d) for d in range(len(self.branch_sizes)))

    def padded(self, width: int) -> int:
        return sum(chunks(width))


def make_plan(network, obs_dim: int, max_chunk: int | None = None) -> Plan:
    """The :class:`Plan` of a ``QNetwork`` (its static fields) for observations of ``obs_dim``;
    GEMM operand blocks at most ``max_chunk`` wide (default: ``tuning.MAX_CHUNK`` of the
    dtype)."""
    if max_chunk is None:
        max_chunk = MAX_CHUNK[network.dtype]
    if max_chunk < ALIGN or max_chunk & (max_chunk - 1):
        raise ValueError(f"make_plan: max_chunk must be a power of two >= {ALIGN}, "
                         f"got {max_chunk}")
    return Plan(obs_dim=int(obs_dim), trunk=tuple(int(w) for w in network.trunk),
                head=int(network.head), atoms=int(network.atoms),
                branch_sizes=tuple(int(n) for n in network.branch_sizes),
                max_chunk=int(max_chunk))


def _pad2(x: jax.Array, rows: int, cols: int) -> jax.Array:
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


def pack_params(params: Any, plan: Plan, dtype: str) -> dict:
    """Flax ``QNetwork`` params -> zero-padded kernel operands (weights in the GEMM dtype).

    Returns a dict of arrays: ``trunk_i_w [in_p, out_p]`` and ``trunk_i_b [out_p]`` f32;
    ``value_hidden_w/b``, ``value_out_w [head_p, Kp]``, ``value_out_b [Kp]``;
    ``adv{d}_hidden_w/b``, ``adv{d}_out_w [head_p, n_pad * Kp]`` (column ``a * Kp + k`` holds
    atom k of action a), ``adv{d}_out_b``. Bias and padding entries are exactly zero.
    """
    p = params["params"] if "params" in params else params
    cd = DTYPES[dtype]
    out = {}

    def dense(name, in_w, out_w):
        w = jnp.asarray(p[name]["kernel"], jnp.float32)
        b = jnp.asarray(p[name]["bias"], jnp.float32)
        out[name + "_w"] = _pad2(w, in_w, out_w).astype(cd)
        out[name + "_b"] = jnp.pad(b, (0, out_w - b.shape[0]))

    width = plan.obs_dim
    for i, w in enumerate(plan.trunk):
        dense(f"trunk_{i}", plan.padded(width), plan.padded(w))
        width = w
    hp, k, kp = plan.padded(plan.trunk[-1]), plan.atoms, plan.atoms_pad
    head_p = plan.padded(plan.head)
    dense("value_hidden", hp, head_p)
    dense("value_out", head_p, kp)
    for d, n in enumerate(plan.branch_sizes):
        dense(f"adv{d}_hidden", hp, head_p)
        npad = plan.actions_pad(d)
        w = jnp.asarray(p[f"adv{d}_out"]["kernel"], jnp.float32).reshape(plan.head, n, k)
        b = jnp.asarray(p[f"adv{d}_out"]["bias"], jnp.float32).reshape(n, k)
        w = jnp.pad(w, ((0, head_p - plan.head), (0, npad - n), (0, kp - k)))
        out[f"adv{d}_out_w"] = w.reshape(head_p, npad * kp).astype(cd)
        out[f"adv{d}_out_b"] = jnp.pad(b, ((0, npad - n), (0, kp - k))).reshape(npad * kp)
    return out


def operand_names(plan: Plan) -> tuple[str, ...]:
    """The order in which :func:`pack_params` operands are passed to the kernel."""
    names = []
    for i in range(len(plan.trunk)):
        names += [f"trunk_{i}_w", f"trunk_{i}_b"]
    names += ["value_hidden_w", "value_hidden_b", "value_out_w", "value_out_b"]
    for d in range(len(plan.branch_sizes)):
        names += [f"adv{d}_hidden_w", f"adv{d}_hidden_b", f"adv{d}_out_w", f"adv{d}_out_b"]
    return tuple(names)


# --- the kernel -----------------------------------------------------------------------------

class _Blocks:
    """Reads parameter blocks for one forward, in the order the forward multiplies them.

    ``blocks(name, cols, rows=None)`` returns ``ops[name][rows, cols]`` (offset, size pairs;
    ``rows`` None for a bias). With ``lookahead`` k > 0 the loads run k weight blocks ahead of
    use: the next k weight blocks (and the biases before them) are read before a block is handed
    out, so their memory latency overlaps the products in between. Triton issues a load where
    the program has it, so without this each product first waits for its block. That pays
    where a program's row blocks are full (the Q-forward at large N, a population's rollout);
    :mod:`pallas_kernels.tuning` holds the depths. The order is
    recorded by a first, abstract pass of the same forward (``ops=None``: blocks are zeros,
    nothing is read), so it has one definition.
    """

    def __init__(self, ops: dict | None, cd, order: list | None = None, lookahead: int = 0):
        self.ops, self.cd, self.order, self.k = ops, cd, order, lookahead
        self.pos, self.ready = 0, {}

    def _read(self, key):
        name, cols, rows = key
        ref = self.ops[name]
        return ref[pl.ds(*cols)] if rows is None else ref[pl.ds(*rows), pl.ds(*cols)]

    def start(self) -> None:
        """Issues the loads the first block would (a caller can overlap them with its own)."""
        if self.k:
            self._ahead(0)

    def _ahead(self, i: int) -> None:
        ahead, j = 0, i
        while j < len(self.order) and (j == i or ahead < self.k or self.order[j][2] is None):
            if j not in self.ready:
                self.ready[j] = self._read(self.order[j])
            ahead += int(j > i and self.order[j][2] is not None)
            j += 1

    def __call__(self, name: str, cols: tuple, rows: tuple | None = None):
        key = (name, cols, rows)
        if self.ops is None:  # the recording pass
            self.order.append(key)
            shape = (cols[1],) if rows is None else (rows[1], cols[1])
            return jnp.zeros(shape, jnp.float32 if rows is None else self.cd)
        if not self.k:
            return self._read(key)
        i = self.pos
        if self.order[i] != key:
            raise AssertionError(f"_Blocks: block {i} is {key}, recorded {self.order[i]}")
        self._ahead(i)
        self.pos += 1
        return self.ready.pop(i)


def _dense(xs, in_sizes, blocks, name: str, out_sizes, cd, relu: bool, col0: int = 0):
    """Block GEMM: input chunks ``xs[i] [BM, in_sizes[i]]`` -> output chunks (float32).

    Reads weight blocks ``name_w[r:r+c, col0+o:col0+o+s]`` at static offsets through ``blocks``
    (:class:`_Blocks`), so every loaded tile has power-of-two sides.
    """
    precision = jax.lax.Precision.HIGHEST if cd == jnp.float32 else None
    outs = []
    for o, s in zip(offsets_of(out_sizes), out_sizes):
        acc = None
        for r, c, x in zip(offsets_of(in_sizes), in_sizes, xs):
            w = blocks(name + "_w", (col0 + o, s), (r, c))
            y = jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)
            acc = y if acc is None else acc + y
        acc = acc + blocks(name + "_b", (col0 + o, s))[None, :]
        outs.append(jnp.maximum(acc, 0.0) if relu else acc)
    return outs


def _softmax_mean(logits, z, axis):
    """Expected value of the atom distribution: ``sum softmax(logits) * z`` over ``axis``."""
    m = jnp.max(logits, axis=axis, keepdims=True)
    e = jnp.exp(logits - m)
    return jnp.sum(e * z, axis=axis) / jnp.sum(e, axis=axis)


def read_blocks(plan: Plan, cd, layout: str, ops: dict, rows: int,
                lookahead: int = 0) -> _Blocks:
    """The parameter-block reader of one forward of ``rows`` rows (:class:`_Blocks`); with a
    ``lookahead`` it first records the order in which the forward reads the blocks."""
    order = None
    if lookahead:
        order = []
        xs = [jax.ShapeDtypeStruct((rows, c), cd) for c in plan.chunks(plan.obs_dim)]
        jax.eval_shape(lambda xs_: forward_rows(plan, cd, layout, _Blocks(None, cd, order), xs_,
                                                None, greedy=False), xs)
    return _Blocks(ops, cd, order, lookahead)


def forward_rows(plan: Plan, cd, layout: str, blocks: _Blocks, xs: list, z, on_q=None,
                 on_logits=None, on_action=None, *, greedy: bool = True) -> list:
    """The network on one block of rows inside a kernel -> per-branch greedy actions.

    ``xs``: the observation block as chunks ``[BM, c]`` (``plan.chunks(obs_dim)``) in the GEMM
    dtype; ``blocks``: the parameters' reader (:func:`read_blocks`); ``z`` ``[Kp]`` f32 (zero
    past K; None when not ``greedy``). ``on_q(d, q)`` (optional) receives branch d's expected
    Q: ``[BM, n_pad]`` (grouped, -inf past n_d) or, per action a, ``on_q((d, a), q [BM])``
    (per_action).
    ``on_logits`` (optional) receives the dueling logits the same way: ``on_logits(d, [BM,
    n_pad, Kp])`` or ``on_logits((d, a), [BM, Kp])``; entries past n_d or K are padding
    (finite, to be dropped). ``greedy=False`` stops after the logits (no softmax, expected Q or
    argmax; for ``on_logits`` alone). ``on_action(d, action [BM], logits)`` (optional) receives
    branch d's greedy action with the logits it was chosen from, padded atoms at -inf
    (grouped ``[BM, n_pad, Kp]``, per action a list of n_d ``[BM, Kp]``; :class:`TakenLogits`).
    Returns ``B`` int32 ``[BM]`` arrays, the first of equal maxima (as ``jnp.argmax``), or an
    empty list when not ``greedy``.
    """
    sizes = plan.chunks(plan.obs_dim)
    for i, w in enumerate(plan.trunk):
        out_sizes = plan.chunks(w)
        hs = _dense(xs, sizes, blocks, f"trunk_{i}", out_sizes, cd, True)
        xs, sizes = [h.astype(cd) for h in hs], out_sizes
    head_sizes = plan.chunks(plan.head)
    kp, k = plan.atoms_pad, plan.atoms

    def hidden(name):
        return [h.astype(cd) for h in _dense(xs, sizes, blocks, name, head_sizes, cd, True)]

    hv = hidden("value_hidden")
    [v] = _dense(hv, head_sizes, blocks, "value_out", (kp,), cd, False)
    atom_ok = jax.lax.broadcasted_iota(jnp.int32, (1, kp), 1) < k
    neg_inf = jnp.float32(-jnp.inf)
    actions = []
    for d, n in enumerate(plan.branch_sizes):
        npad = plan.actions_pad(d)
        ha = hidden(f"adv{d}_hidden")
        if layout == "grouped":
            [a] = _dense(ha, head_sizes, blocks, f"adv{d}_out", (npad * kp,), cd, False)
            a = a.reshape(a.shape[0], npad, kp)
            # padded actions are exact zeros, so the sum over all npad rows is the sum over n
            mean = jnp.sum(a, axis=1) * jnp.float32(1.0 / n)
            logits = v[:, None, :] + a - mean[:, None, :]
            if on_logits is not None:
                on_logits(d, logits)
            if not greedy:
                continue
            logits = jnp.where(atom_ok[:, None, :], logits, neg_inf)
            q = _softmax_mean(logits, z[None, None, :], axis=2)  # [BM, npad]
            act_ok = jax.lax.broadcasted_iota(jnp.int32, (1, npad), 1) < n
            q = jnp.where(act_ok, q, neg_inf)
            if on_q is not None:
                on_q(d, q)
            actions.append(jnp.argmax(q, axis=1).astype(jnp.int32))
            if on_action is not None:
                on_action(d, actions[-1], logits)
        else:
            advs = [_dense(ha, head_sizes, blocks, f"adv{d}_out", (kp,), cd, False,
                           col0=a * kp)[0] for a in range(n)]
            mean = advs[0]
            for a_t in advs[1:]:
                mean = mean + a_t
            mean = mean * jnp.float32(1.0 / n)
            best_q = best_a = None
            masked = []
            for a, a_t in enumerate(advs):
                if on_logits is not None:
                    on_logits((d, a), v + a_t - mean)
                if not greedy:
                    continue
                logits = jnp.where(atom_ok, v + a_t - mean, neg_inf)
                masked.append(logits)
                q = _softmax_mean(logits, z[None, :], axis=1)  # [BM]
                if on_q is not None:
                    on_q((d, a), q)
                if a == 0:
                    best_q, best_a = q, jnp.zeros(q.shape, jnp.int32)
                else:  # strict '>' keeps the first of equal maxima, as jnp.argmax does
                    better = q > best_q
                    best_q = jnp.where(better, q, best_q)
                    best_a = jnp.where(better, jnp.int32(a), best_a)
            if greedy:
                actions.append(best_a)
                if on_action is not None:
                    on_action(d, best_a, masked)
    return actions


def add_if_taken(total, logits: jax.Array, action: jax.Array, a: int) -> jax.Array:
    """One term of the masked sum over a branch's actions: ``total + logits`` on the rows whose
    ``action [BM]`` is ``a``, ``total`` elsewhere (``None`` starts the sum at action 0).
    Exactly one action of a row matches, so after the last action the sum is its logits."""
    hit = jnp.where((action == a)[:, None], logits, 0.0)
    return hit if total is None else total + hit


def pick_logits(logits, action: jax.Array) -> jax.Array:
    """One action's logits per row: grouped ``[BM, n_pad, Kp]`` or, per action, a list of
    ``[BM, Kp]``; ``action [BM]`` int32 -> ``[BM, Kp]``. A masked sum, as
    :func:`foxhunt_jax.agent.network.select_action`: exactly one term is nonzero."""
    if isinstance(logits, list):
        out = None
        for a, lg in enumerate(logits):
            out = add_if_taken(out, lg, action, a)
        return out
    hit = (jax.lax.broadcasted_iota(jnp.int32, (1, logits.shape[1], 1), 1)
           == action[:, None, None])
    return jnp.sum(jnp.where(hit, logits, 0.0), axis=1)


class TakenLogits:
    """A :func:`forward_rows` ``on_action`` callback that hands on each branch's logits of the
    action taken: the explore draw where ``draw(d) [BM]`` is >= 0, else the greedy action
    (``draw`` None: always greedy). ``store(d, logits [BM, Kp])`` receives them, padded atoms
    at -inf. It picks from the logits the greedy softmax already holds rather than keeping a
    copy of the unmasked ones alive through the softmax, which costs registers."""

    def __init__(self, store, draw=None):
        self.store, self.draw = store, draw

    def __call__(self, d: int, greedy: jax.Array, logits) -> None:
        taken = greedy if self.draw is None else apply_draws(self.draw(d), greedy)
        self.store(d, pick_logits(logits, taken))


def c51_rows(taken, target, returns, discounts, z, atoms: int):
    """One branch's C51 loss per row inside a kernel (:func:`foxhunt_jax.agent.loss.c51_loss`):
    ``taken``, ``target`` ``[BM, Kp]`` logits of the taken action at s and of the bootstrap
    action at s' (entries past ``atoms`` ignored), ``returns``, ``discounts`` ``[BM]``, ``z``
    ``[Kp]`` the support (zero past ``atoms``) -> ``[BM]`` float32.

    The cross-entropy ``-sum_i m_i log q_i`` of the projected target ``m_i = sum_j p_j w_ji``
    is summed in the other order, ``-sum_j p_j sum_i w_ji log q_i`` (the triangular weights
    ``w`` of :func:`~foxhunt_jax.agent.loss.categorical_projection`), one atom ``i`` at a time:
    only ``[BM, Kp]`` tensors are live, where the ``[BM, Kp, Kp]`` weights would not fit in
    registers.
    """
    kp = z.shape[0]
    atom = jax.lax.broadcasted_iota(jnp.int32, (1, kp), 1)
    ok = atom < atoms
    neg_inf = jnp.float32(-jnp.inf)
    t = jnp.where(ok, target, neg_inf)
    e = jnp.exp(t - jnp.max(t, axis=1, keepdims=True))
    p = e / jnp.sum(e, axis=1, keepdims=True)  # exact zeros past atoms
    q = jnp.where(ok, taken, neg_inf)
    q = q - jnp.max(q, axis=1, keepdims=True)
    log_q = jnp.where(ok, q - jnp.log(jnp.sum(jnp.exp(q), axis=1, keepdims=True)), 0.0)
    v_min = jnp.sum(jnp.where(atom[0] == 0, z, 0.0))
    v_max = jnp.sum(jnp.where(atom[0] == atoms - 1, z, 0.0))
    dz = (v_max - v_min) / (atoms - 1)
    tz = jnp.clip(returns[:, None] + discounts[:, None] * z[None, :], v_min, v_max)
    b = jnp.clip((tz - v_min) / dz, 0.0, atoms - 1.0)  # [BM, Kp] fractional target index
    interp = jnp.zeros(b.shape, jnp.float32)  # sum_i w_ji log q_i
    for i in range(atoms):
        log_q_i = jnp.sum(jnp.where(atom == i, log_q, 0.0), axis=1)
        interp = interp + jnp.maximum(0.0, 1.0 - jnp.abs(b - i)) * log_q_i[:, None]
    return -jnp.sum(p * interp, axis=1)


def _kernel(plan: Plan, cd, config: KernelConfig, with_q: bool, with_logits: bool,
            greedy: bool, select: str | None, x_ref, *refs):
    """Inputs: the observation block, the support ``[Kp]`` (``greedy`` or ``select="loss"``),
    the actions ``[BM, B]`` (``select="given"`` or ``"loss"``) or the explore draws ``[BM, B]``
    (``select="explore"``), with ``select="loss"`` each branch's taken logits ``[BM, Kp]``,
    the returns and the discounts ``[BM]``, then the parameter operands. Outputs, in order:
    expected Q (``with_q``), per branch one logits block ``[BM, n_pad, Kp]`` (``with_logits``)
    or, with ``select``, the logits of the given or the taken action ``[BM, Kp]``, or with
    ``select="loss"`` the C51 loss ``[BM]`` (:func:`c51_rows`, mean over branches), then the
    greedy actions (``greedy``)."""
    z = sel_ref = None
    if greedy or select == "loss":
        z, refs = refs[0][...], refs[1:]
    if select:
        sel_ref, refs = refs[0], refs[1:]
    nb = len(plan.branch_sizes)
    if select == "loss":
        taken_refs, ret_ref, disc_ref, refs = refs[:nb], refs[nb], refs[nb + 1], refs[nb + 2:]
        target = {}  # per branch, the picked logits (per action: the running masked sum)
    n_ops = len(operand_names(plan))
    ops = dict(zip(operand_names(plan), refs[:n_ops]))
    outs = refs[n_ops:]
    q_ref = outs[0] if with_q else None
    logit_refs = outs[int(with_q):len(outs) - int(greedy)]
    act_ref = outs[-1] if greedy else None

    def store_logits(where, logits):
        if select == "loss":  # keep the bootstrap action's logits for the loss below
            d, a = where if isinstance(where, tuple) else (where, None)
            if a is None:
                target[d] = pick_logits(logits, sel_ref[:, d])
            else:
                target[d] = add_if_taken(target.get(d) if a else None, logits, sel_ref[:, d], a)
        elif isinstance(where, tuple):
            d, a = where
            if not select:
                logit_refs[d][:, a, :] = logits
            else:  # the running sum lives in the output block
                logit_refs[d][...] = add_if_taken(logit_refs[d][...] if a else None, logits,
                                                  sel_ref[:, d], a)
        elif select:
            logit_refs[where][...] = pick_logits(logits, sel_ref[:, where])
        else:
            logit_refs[where][...] = logits

    def store_q(where, q):
        if isinstance(where, tuple):
            d, a = where
            q_ref[:, plan.q_offsets[d] + a] = q
        else:
            q_ref[:, pl.ds(plan.q_offsets[where], plan.actions_pad(where))] = q

    on_logits = store_logits if with_logits and select != "explore" else None
    on_action = None
    if select == "explore":  # the taken action is known only after the branch's greedy one

        def store_taken(d, logits):
            logit_refs[d][...] = logits
        on_action = TakenLogits(store_taken, lambda d: sel_ref[:, d])

    blocks = read_blocks(plan, cd, config.layout, ops, x_ref.shape[0], config.lookahead)
    blocks.start()
    sizes = plan.chunks(plan.obs_dim)
    xs = [x_ref[:, pl.ds(o, c)] for o, c in zip(offsets_of(sizes), sizes)]
    actions = forward_rows(plan, cd, config.layout, blocks, xs, z,
                           store_q if with_q else None, on_logits, on_action, greedy=greedy)
    for d, a in enumerate(actions):
        act_ref[:, d] = a
    if select == "loss":
        ret, disc = ret_ref[...], disc_ref[...]
        total = None
        for d in range(nb):
            loss_d = c51_rows(taken_refs[d][...], target[d], ret, disc, z, plan.atoms)
            total = loss_d if total is None else total + loss_d
        logit_refs[0][...] = total * jnp.float32(1.0 / nb)


# --- the public function ----------------------------------------------------------------------

def launch(kernel, name: str, config: KernelConfig, block_rows: int, grid: int, in_specs,
           out_specs, out_shape, interpret: bool | None, aliases: dict | None = None):
    """``pl.pallas_call`` over a 1-D grid: Triton-compiled with ``config``'s warps and stages,
    or interpreted (``interpret=None``: as :func:`pallas_kernels.tuning.for_device` says for the
    default device). ``aliases``: ``{input index: output index}`` buffers updated in place."""
    if interpret is None:
        interpret = not for_device().compiled
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton
        # small blocks have few rows of tensor-core tiles: more warps would only wait
        warps = min(config.num_warps, max(config.min_warps, block_rows // 8))
        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=warps,
                                                           num_stages=config.num_stages)

    def run(*args):
        with warnings.catch_warnings():
            # JAX 0.11 marks Pallas' Triton backend deprecated; it is still the GPU path with
            # gathers
            warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
            return pl.pallas_call(kernel, out_shape=out_shape, grid=(grid,), in_specs=in_specs,
                                  out_specs=out_specs, interpret=interpret, name=name,
                                  input_output_aliases=aliases or {}, **kwargs)(*args)
    return run


def _run(params: Any, obs: jax.Array, network, support: jax.Array | None, with_q: bool,
         with_logits: bool, config: KernelConfig | None, interpret: bool | None,
         actions: jax.Array | None = None, draws: jax.Array | None = None,
         loss_args: tuple | None = None):
    """The kernel over ``obs [N, D]``: (q tuple or None, logits tuple or None, actions [N, B]
    or None). ``support`` None stops the kernel at the logits (no greedy tail, no actions).
    ``actions [N, B]`` (with ``with_logits``): each branch's logits of that action only,
    ``[N, K]``, instead of all of them; ``draws [N, B]`` (with ``with_logits`` and
    ``support``): those of the action taken, the draw where it is >= 0, else the greedy one.
    ``loss_args = (support, taken, returns, discounts)`` (with ``actions``, ``with_logits``
    and no ``support``): the logits are the C51 loss ``[N]`` instead (:func:`c51_rows`)."""
    greedy = support is not None
    if actions is not None and draws is not None:
        raise ValueError("q_forward kernel: give actions or draws, not both")
    select = "given" if actions is not None else "explore" if draws is not None else None
    if select == "explore" and not (greedy and with_logits):
        raise ValueError("q_forward kernel: draws need the greedy tail and the logits")
    if loss_args is not None:
        if not (select == "given" and with_logits and not greedy and not with_q):
            raise ValueError("q_forward kernel: the loss needs the bootstrap actions alone")
        select = "loss"
    if config is None:
        config = for_device().q_forward_config(network.dtype)
    if config.layout not in LAYOUTS:
        raise ValueError(f"q_forward kernel: layout must be one of {LAYOUTS}, got "
                         f"{config.layout!r}")
    n, dim = obs.shape
    plan = make_plan(network, dim, config.max_chunk)
    cd = DTYPES[network.dtype]
    bm = block_rows_for(n, config)
    rows = -(-n // bm) * bm
    dp = plan.padded(dim)
    x = _pad2(jnp.asarray(obs, jnp.float32), rows, dp).astype(cd)
    packed = pack_params(params, plan, network.dtype)
    operands = [packed[k] for k in operand_names(plan)]
    nb, kp = len(plan.branch_sizes), plan.atoms_pad

    full = lambda a: pl.BlockSpec(a.shape, lambda i, _nd=a.ndim: (0,) * _nd)
    inputs = [x]
    in_specs = [pl.BlockSpec((bm, dp), lambda i: (i, 0))]
    z = support if greedy else loss_args[0] if loss_args is not None else None
    if z is not None:  # the greedy tail's or the loss's support
        inputs.append(jnp.pad(jnp.asarray(z, jnp.float32), (0, kp - plan.atoms)))
        in_specs.append(full(inputs[-1]))
    if select:
        inputs.append(_pad2(jnp.asarray(actions if draws is None else draws, jnp.int32), rows,
                            nb))
        in_specs.append(pl.BlockSpec((bm, nb), lambda i: (i, 0)))
    if select == "loss":
        _, taken, returns, discounts = loss_args
        inputs += [_pad2(jnp.asarray(t, jnp.float32), rows, kp) for t in taken]
        in_specs += [pl.BlockSpec((bm, kp), lambda i: (i, 0))] * nb
        inputs += [jnp.pad(jnp.asarray(v, jnp.float32), (0, rows - n))
                   for v in (returns, discounts)]
        in_specs += [pl.BlockSpec((bm,), lambda i: (i,))] * 2
    inputs += operands
    in_specs += [full(a) for a in operands]
    out_shape, out_specs = [], []
    if with_q:
        out_shape.append(jax.ShapeDtypeStruct((rows, plan.q_width), jnp.float32))
        out_specs.append(pl.BlockSpec((bm, plan.q_width), lambda i: (i, 0)))
    if select == "loss":
        out_shape.append(jax.ShapeDtypeStruct((rows,), jnp.float32))
        out_specs.append(pl.BlockSpec((bm,), lambda i: (i,)))
    elif with_logits and select:
        out_shape += [jax.ShapeDtypeStruct((rows, kp), jnp.float32)] * nb
        out_specs += [pl.BlockSpec((bm, kp), lambda i: (i, 0))] * nb
    elif with_logits:
        for d in range(nb):
            npad = plan.actions_pad(d)
            out_shape.append(jax.ShapeDtypeStruct((rows, npad, kp), jnp.float32))
            out_specs.append(pl.BlockSpec((bm, npad, kp), lambda i: (i, 0, 0)))
    if greedy:
        out_shape.append(jax.ShapeDtypeStruct((rows, nb), jnp.int32))
        out_specs.append(pl.BlockSpec((bm, nb), lambda i: (i, 0)))

    kernel = functools.partial(_kernel, plan, cd, config, with_q, with_logits, greedy, select)
    outs = launch(kernel, "fused_q_forward", config, bm, rows // bm, in_specs, tuple(out_specs),
                  tuple(out_shape), interpret)(*inputs)
    q = logits = None
    if with_q:
        q = tuple(outs[0][:n, o:o + nd] for o, nd in zip(plan.q_offsets, plan.branch_sizes))
    if select == "loss":
        return None, outs[0][:n], None
    if with_logits:
        blocks_out = outs[int(with_q):len(outs) - int(greedy)]
        logits = (tuple(x[:n, :plan.atoms] for x in blocks_out) if select else
                  tuple(x[:n, :nd, :plan.atoms] for x, nd in zip(blocks_out, plan.branch_sizes)))
    return q, logits, outs[-1][:n] if greedy else None


def fused_q_forward(params: Any, obs: jax.Array, network, support: jax.Array, *,
                    with_q: bool = True, config: KernelConfig | None = None,
                    interpret: bool | None = None):
    """Greedy actions (and expected Q) of ``network`` at ``obs`` in one fused kernel.

    Args:
      params: the ``QNetwork`` parameter pytree (``{"params": {...}}`` as ``init`` returns).
      obs: ``[N, D]`` observations (any float dtype; rows are independent).
      network: the ``QNetwork`` (its static fields define the layout and the GEMM dtype).
      support: ``[K]`` float32 atom values.
      with_q: also return the expected Q values.
      config: launch shape (default: the tuning table's for the default device and
        ``network.dtype``); ``interpret=None``: interpreted unless that device compiles Triton.
    Returns:
      ``(q, actions)``: ``q`` a tuple over branches of ``[N, n_d]`` float32 expected Q (None
      when ``with_q`` is False) and ``actions [N, B]`` int32, the per-branch argmax (the first
      of equal maxima).
    """
    q, _, actions = _run(params, obs, network, support, with_q, False, config, interpret)
    return q, actions


def fused_logits(params: Any, obs: jax.Array, network, *, actions: jax.Array | None = None,
                 config: KernelConfig | None = None,
                 interpret: bool | None = None) -> tuple[jax.Array, ...]:
    """``network.apply(params, obs)`` in one fused kernel: per-branch logits ``[N, n_d, K]``
    float32 of ``obs [N, D]`` (no gradient; the learner's update keeps the Flax forward).

    Each program writes its rows' logits padded to ``[BM, n_pad, Kp]`` per branch (Triton's
    power-of-two blocks); the padding is sliced off outside the kernel. The kernel stops at the
    logits: no softmax, expected Q or actions.

    With ``actions [N, B]`` int32 it returns, per branch, only the logits of that action,
    ``[N, K]`` (``network.select_action`` of each branch): a C51 loss reads one action's
    distribution per branch, so the kernel writes ``B * Kp`` floats a row instead of
    ``sum n_pad * Kp``.
    """
    _, logits, _ = _run(params, obs, network, None, False, True, config, interpret, actions)
    return logits


def fused_act(params: Any, obs: jax.Array, network, support: jax.Array, draws: jax.Array, *,
              config: KernelConfig | None = None, interpret: bool | None = None):
    """The collection forward in one fused kernel: greedy actions at ``obs [N, D]`` and each
    branch's logits of the action taken under the explore draws ``draws [N, B]`` int32
    (:func:`foxhunt_jax.agent.network.explore_draws`: the draw where it is >= 0, else the
    greedy action).

    Returns ``(greedy [N, B] int32, taken)``, ``taken`` a tuple over branches of ``[N, K]``
    float32 (``network.act``'s results; the kernel writes ``B * (Kp + 1)`` values a row).
    """
    _, logits, greedy = _run(params, obs, network, support, False, True, config, interpret,
                             draws=draws)
    return greedy, logits


def fused_bootstrap_loss(target_params: Any, next_obs: jax.Array, network, support: jax.Array,
                         best: jax.Array, taken: Sequence[jax.Array], returns: jax.Array,
                         discounts: jax.Array, *, config: KernelConfig | None = None,
                         interpret: bool | None = None) -> jax.Array:
    """The C51 loss against the target network's bootstrap distribution, in one fused kernel:
    ``c51_loss(taken, taken_logits(target_params, next_obs, best), returns, discounts,
    support)`` (:func:`foxhunt_jax.agent.loss.c51_loss`).

    Args:
      target_params: the target ``QNetwork``'s parameters; ``next_obs`` ``[N, D]`` the
        bootstrap observations; ``best`` ``[N, B]`` int32 the action each branch bootstraps
        from (double Q: the online network's greedy one).
      taken: a tuple over branches of ``[N, K]`` online logits of the taken actions at s.
      returns, discounts: ``[N]`` float32.
    Returns:
      ``[N]`` float32, the loss per row (mean over branches). The kernel writes one float a
      row; the target logits, their softmax and the projection stay on chip (no gradient).
    """
    _, loss, _ = _run(target_params, next_obs, network, None, False, True, config, interpret,
                      best, loss_args=(support, tuple(taken), returns, discounts))
    return loss


def forward_flops(obs_dim: int, trunk: Sequence[int], head: int, atoms: int,
                  branch_sizes: Sequence[int]) -> int:
    """Multiply-add FLOPs (2 per MAC) of one row through the ten GEMMs (unpadded widths)."""
    macs, width = 0, obs_dim
    for w in trunk:
        macs += width * w
        width = w
    macs += width * head + head * atoms  # value stream
    for n in branch_sizes:
        macs += width * head + head * n * atoms
    return 2 * macs


__all__ = ["fused_q_forward", "fused_logits", "fused_act", "fused_bootstrap_loss", "c51_rows",
           "forward_rows", "pick_logits",
           "TakenLogits", "read_blocks", "launch",
           "apply_draws", "operand_names", "pack_params", "make_plan", "Plan", "KernelConfig",
           "LAYOUTS", "ALIGN", "DTYPES", "chunks", "offsets_of",
           "forward_flops"]
