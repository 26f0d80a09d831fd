"""The branching, dueling, distributional (C51) Q-network and the helpers around it.

One forward function serves every caller: the learner (online on s, target on s', online on s'),
experience collection and inference all call :meth:`QNetwork.apply`. Collection reaches it
through :func:`act`, inference through :func:`q_forward`, and the loss's no-gradient callers
(initial priorities, the validation loss) through :func:`taken_logits`. These three are the
definitions that :mod:`foxhunt_jax.backend` serves: its ``xla`` backend runs them as written,
its ``pallas`` backend as fused kernels (``pallas_kernels/q_forward.py``) tested equal to them.

Layout with the default 3 branches (ten Dense layers, 20 tensors)::

    obs [..., D] -> trunk_0 -> ReLU -> trunk_1 -> ReLU -> h [..., 256]
    h -> value_hidden -> ReLU -> value_out                  -> V   [..., K]
    h -> adv{d}_hidden -> ReLU -> adv{d}_out -> reshape      -> A_d [..., n_d, K]
    logits_d = V[..., None, :] + A_d - mean_a A_d            (dueling in logit space)

Shapes: ``D`` observation width, ``B`` branches, ``n_d`` actions of branch d, ``K`` atoms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from foxhunt_jax.config import NetworkConfig
from foxhunt_jax.errors import ConfigError
from pallas_kernels.q_forward import DTYPES, apply_draws

# f32-accurate GEMMs without TF32 (XLA's default f32 algorithm on Ampere+ GPUs keeps 10 mantissa
# bits). F32_PRECISION splits each f32 operand into three bf16 parts and multiplies them on
# tensor cores as six bf16 products with f32 accumulation: as accurate against float64 as true
# f32 products (Precision.HIGHEST), and faster on a GPU from about a thousand rows and to
# compile (XLA's autotuner no longer compiles f32 FMA GEMM tilings). At a few dozen rows (a
# learner batch, the validation windows) its extra products cost more than they save, so those
# GEMMs keep HIGHEST. The CPU computes both as plain f32.
# Every float32 GEMM of the library's networks (Q and RND) goes through Dense and this rule.
F32_PRECISION = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6
F32_PRECISION_MIN_ROWS = 1024
# Three bf16 products instead of six (the operands' two leading bf16 parts): a float32 layer may
# ask for it where about 16 mantissa bits are enough (the curiosity pass of a bfloat16 run,
# CuriosityConfig.precision), for fewer products
F32_FAST_PRECISION = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3


def f32_precision(rows: int, fast: bool = False):
    """The algorithm of a float32 GEMM of ``rows`` rows (static): :data:`F32_PRECISION` (or,
    with ``fast``, :data:`F32_FAST_PRECISION`) from :data:`F32_PRECISION_MIN_ROWS` rows,
    ``Precision.HIGHEST`` below."""
    if rows < F32_PRECISION_MIN_ROWS:
        return jax.lax.Precision.HIGHEST
    return F32_FAST_PRECISION if fast else F32_PRECISION


class Dense(nn.Module):
    """Affine layer with float32 parameters and a chosen GEMM input dtype.

    The matrix inputs (activations and kernel) are cast to ``compute_dtype`` and the product
    accumulates in float32 (``preferred_element_type``); the bias is added in float32. With
    ``compute_dtype=float32`` this is an ordinary f32 Dense layer with f32-accurate products
    (:func:`f32_precision`; ``fast_f32`` trades them for three bf16 products from 1,024 rows).
    The parameter names (``kernel [in, out]``, ``bias [out]``) and initializers match
    ``flax.linen.Dense``.
    """

    features: int
    compute_dtype: Any = jnp.float32
    fast_f32: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                            jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
        # float32 means f32-accurate products (f32_precision), not TF32; under vmap the rows
        # seen here are one example's
        rows = math.prod(x.shape[:-1])
        precision = (f32_precision(rows, self.fast_f32) if self.compute_dtype == jnp.float32
                     else None)
        y = jnp.dot(x.astype(self.compute_dtype), kernel.astype(self.compute_dtype),
                    precision=precision, preferred_element_type=jnp.float32)
        return y + bias


class QNetwork(nn.Module):
    """Branching dueling C51 Q-network.

    Attributes:
      branch_sizes: actions per branch ``(n_0, ..., n_{B-1})``.
      trunk: widths of the shared hidden layers (ReLU after each).
      head: hidden width of the value stream and of each advantage stream.
      atoms: ``K``, the number of support atoms.
      dtype: ``"float32"`` or ``"bfloat16"``: the dtype of the matrix inputs of every GEMM.
        Parameters, accumulation and the returned logits are float32 either way.

    ``apply(params, obs [..., D])`` returns a tuple of ``B`` float32 arrays ``[..., n_d, K]``.
    """

    branch_sizes: tuple[int, ...]
    trunk: tuple[int, ...] = (256, 256)
    head: int = 160
    atoms: int = 11
    dtype: str = "float32"

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[jax.Array, ...]:
        if self.dtype not in DTYPES:
            raise ConfigError(f"QNetwork dtype must be float32 or bfloat16, got {self.dtype!r}")
        cd = DTYPES[self.dtype]
        h = jnp.asarray(obs, jnp.float32)
        for i, width in enumerate(self.trunk):
            h = nn.relu(Dense(width, cd, name=f"trunk_{i}")(h))

        v = nn.relu(Dense(self.head, cd, name="value_hidden")(h))
        v = Dense(self.atoms, cd, name="value_out")(v)  # [..., K]

        out = []
        for d, n_d in enumerate(self.branch_sizes):
            a = nn.relu(Dense(self.head, cd, name=f"adv{d}_hidden")(h))
            a = Dense(n_d * self.atoms, cd, name=f"adv{d}_out")(a)
            a = a.reshape(a.shape[:-1] + (n_d, self.atoms))  # [..., n_d, K]
            # Subtracting the mean advantage makes V identifiable: mean_a logits_d == V.
            out.append(v[..., None, :] + a - jnp.mean(a, axis=-2, keepdims=True))
        return tuple(out)


def make_network(net_cfg: NetworkConfig, branch_sizes: Sequence[int]) -> QNetwork:
    """The network of a validated :class:`NetworkConfig` for the env's ``branch_sizes``."""
    sizes = tuple(int(n) for n in branch_sizes)
    if not sizes or any(n < 1 for n in sizes):
        raise ConfigError(f"network branch sizes must be one or more positive counts, got {sizes}")
    # "auto" is made concrete per device by the run (foxhunt_jax.backend.resolve_config); a
    # network built from an unresolved config computes in float32
    dtype = "float32" if net_cfg.dtype == "auto" else net_cfg.dtype
    if dtype not in DTYPES:
        raise ConfigError(f"config key 'network.dtype' must be auto, float32 or bfloat16, got "
                          f"{net_cfg.dtype!r}")
    return QNetwork(branch_sizes=sizes, trunk=tuple(net_cfg.trunk), head=net_cfg.head,
                    atoms=net_cfg.atoms, dtype=dtype)


def compute_params(network: QNetwork, params: Any) -> Any:
    """``params`` with every Dense kernel in the network's GEMM input dtype: what its forward
    reads (:class:`Dense` casts a kernel it is given in that dtype to itself). A float32
    network's parameters are returned as they are.

    The learner keeps these copies through its steps (the update writes them beside the
    float32 parameters), so a step's forwards do not cast the kernels again; a gradient taken
    with respect to them is the one taken through the cast (its transpose), in the kernels'
    dtype.
    """
    dtype = DTYPES[network.dtype]
    if dtype == jnp.float32:
        return params
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(dtype) if getattr(path[-1], "key", None) == "kernel" else x,
        params)


def support(v_min: float, v_max: float, atoms: int) -> jax.Array:
    """Fixed C51 support ``z [K]``: ``atoms`` evenly spaced values from v_min to v_max."""
    return jnp.linspace(v_min, v_max, atoms, dtype=jnp.float32)


def expected_q(logits_d: jax.Array, z: jax.Array) -> jax.Array:
    """Expected value ``sum_i softmax(logits)_i z_i``: ``[..., n, K]``, ``[K]`` -> ``[..., n]``."""
    p = jax.nn.softmax(logits_d.astype(jnp.float32), axis=-1)
    return jnp.sum(p * z, axis=-1)


def greedy_actions(logits: Sequence[jax.Array], z: jax.Array) -> jax.Array:
    """Per-branch argmax of expected Q: tuple of ``[..., n_d, K]`` -> ``[..., B]`` int32."""
    acts = [jnp.argmax(expected_q(l, z), axis=-1).astype(jnp.int32) for l in logits]
    return jnp.stack(acts, axis=-1)


def explore_draws(key: jax.Array, num_rows: int, branch_sizes: Sequence[int],
                  epsilon) -> jax.Array:
    """The random part of per-branch epsilon-greedy: ``[N, B]`` int32, ``-1`` where a branch
    keeps its greedy action, else the uniform random action it takes instead.

    Each branch of each row independently explores with probability ``epsilon``. Keys:
    ``split(key, 2B)``; branch d draws its random action from key ``2d`` and its explore coin
    from key ``2d + 1``.
    """
    keys = jax.random.split(key, 2 * len(branch_sizes))
    cols = []
    for d, n_d in enumerate(branch_sizes):
        rand = jax.random.randint(keys[2 * d], (num_rows,), 0, n_d, jnp.int32)
        explore = jax.random.uniform(keys[2 * d + 1], (num_rows,)) < epsilon
        cols.append(jnp.where(explore, rand, -1))
    return jnp.stack(cols, axis=-1)


def explore_actions(key: jax.Array, greedy: jax.Array, branch_sizes: Sequence[int],
                    epsilon) -> jax.Array:
    """Per-branch epsilon-greedy: ``greedy [N, B]`` int32 -> actions ``[N, B]`` int32
    (:func:`explore_draws` applied to ``greedy``)."""
    return apply_draws(explore_draws(key, greedy.shape[0], branch_sizes, epsilon), greedy)


def q_forward(params: Any, obs: jax.Array, network: QNetwork, z: jax.Array, *,
              with_q: bool = False):
    """The collection/inference forward: greedy actions (and expected Q) at ``obs [..., D]``:
    ``greedy_actions(network.apply(params, obs), z)``.

    Returns ``(q, actions)``: ``q`` a tuple over branches of ``[..., n_d]`` float32 expected Q
    (None unless ``with_q``), ``actions [..., B]`` int32 (per-branch argmax, first of ties).
    """
    logits = network.apply(params, obs)
    q = tuple(expected_q(l, z) for l in logits) if with_q else None
    return q, greedy_actions(logits, z)


def act(params: Any, obs: jax.Array, draws: jax.Array, network: QNetwork,
        z: jax.Array) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """The collection forward: epsilon-greedy actions at ``obs [N, D]`` and what the initial
    priorities reuse of this forward.

    ``draws [N, B]`` int32 from :func:`explore_draws` (-1 = greedy). Returns ``(greedy,
    action, taken)``: ``greedy [N, B]`` int32 (per-branch argmax of expected Q), ``action``
    ``= apply_draws(draws, greedy)`` and ``taken``, a tuple over branches of ``[N, K]`` float32
    logits of the action taken (:func:`taken_logits` of ``action``, from the same forward).
    """
    logits = network.apply(params, obs)
    greedy = greedy_actions(logits, z)
    action = apply_draws(draws, greedy)
    return greedy, action, tuple(select_action(l, action[:, d]) for d, l in enumerate(logits))


def select_action(logits_d: jax.Array, action: jax.Array) -> jax.Array:
    """Logits of one action per row: ``[..., n, K]``, ``[...]`` int -> ``[..., K]``.

    A masked sum over the ``n`` actions rather than a gather: XLA fuses it with its neighbours,
    and its gradient is a select instead of a scatter-add. Exact: one term is nonzero.
    """
    taken = jnp.arange(logits_d.shape[-2]) == action[..., None]
    return jnp.sum(jnp.where(taken[..., None], logits_d, 0.0), axis=-2)


def taken_logits(params: Any, obs: jax.Array, actions: jax.Array,
                 network: QNetwork) -> tuple[jax.Array, ...]:
    """Each branch's logits of one action: ``obs [..., D]``, ``actions [..., B]`` int32 ->
    a tuple over branches of ``[..., K]`` float32 (:func:`select_action` of
    ``network.apply``). A C51 loss needs no more of the network's output.
    """
    logits = network.apply(params, obs)
    return tuple(select_action(l, actions[..., d]) for d, l in enumerate(logits))


# flax's lecun_normal: a normal truncated to [-2, 2], rescaled to unit variance, times 1/sqrt(fan_in)
_TRUNC_STD = 0.87962566103423978


def init_params(module: nn.Module, key: jax.Array, example: jax.Array) -> Any:
    """Parameters of a Dense-layer ``module``: lecun-normal kernels, zero biases, ONE random draw.

    The same distribution and pytree as ``module.init(key, example)`` (flax draws each kernel
    with its own call), but all kernels come from a single truncated-normal draw sliced per
    layer. On XLA:CPU every random call compiles to its own generator kernel, so one draw
    instead of ten makes the start-up compile of the Q-network several times faster.
    """
    shapes = jax.eval_shape(module.init, key, example)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    kernels = [x.size for path, x in leaves if path[-1].key == "kernel"]
    draw = jax.random.truncated_normal(key, -2.0, 2.0, (sum(kernels),), jnp.float32)
    out, offset = [], 0
    for path, x in leaves:
        if path[-1].key == "kernel":
            scale = 1.0 / (_TRUNC_STD * jnp.sqrt(jnp.float32(x.shape[0])))
            out.append(draw[offset:offset + x.size].reshape(x.shape) * scale)
            offset += x.size
        else:
            out.append(jnp.zeros(x.shape, x.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def param_count(params: Any) -> int:
    """Total number of scalars in a parameter tree."""
    return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))


__all__ = ["QNetwork", "Dense", "F32_PRECISION", "F32_PRECISION_MIN_ROWS", "F32_FAST_PRECISION",
           "compute_params", "f32_precision", "make_network", "init_params", "support",
           "expected_q", "greedy_actions", "explore_actions", "explore_draws", "apply_draws",
           "act", "q_forward", "select_action", "taken_logits", "param_count"]
