"""Device-resident ring buffer with proportional prioritized sampling.

The buffer is generic: an *item* is any pytree of arrays (one transition, no batch axis) and the
state stores each leaf with a leading capacity axis ``C``. Every function is pure and jittable;
the jitted variants donate the state so XLA writes in place instead of copying the buffer.

Priorities are stored already transformed, ``q_i = (|p_i| + eps) ** alpha``, so sampling is a plain
proportional draw ``P(i) = q_i / sum_j q_j`` and ``alpha = 0`` stores ones (uniform sampling).
Empty slots hold ``q = 0`` and are never drawn.

Sampling inverts the cumulative mass in two levels: a block of ``S`` slots is drawn by its mass,
then a slot inside the block by a second uniform over the block's own mass. One float32
cumulative sum over millions of slots would be too coarse: at a total mass of 4e6 the float32
spacing is 0.5, about the mass of one slot, so slot boundaries would be off by whole slots. With
two levels a rounding error is relative to a block's mass instead (at most 4096 blocks, so about
5e-4 of a block's probability per float32 spacing, and far less inside a block). The cost is one
pass over the ``C`` priorities per sample (a GPU does 2**22 in microseconds) plus ``M`` rows of
``S`` slots, or for large ``M * S`` of ``S / 32`` sub-block masses and 32 slots.

Shapes: ``C`` capacity, ``n`` items added at once, ``M`` sampled batch, ``S`` block size.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from foxhunt_jax.config import ReplayConfig
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.parallel import shard_keys
from pallas_kernels.tuning import ReplaySearch

_DEFAULT_EPS = ReplayConfig.priority_eps
_MAX_BLOCK = 256  # preferred largest block of the two-level search (sampling gathers M rows of S)
_MAX_BLOCKS = 4096  # most blocks: bounds the float32 error of block boundaries (see block_size)
_TINY = float(np.finfo(np.float32).tiny)  # a stored priority never underflows to an empty slot


@struct.dataclass
class ReplayState:
    """Buffer contents and sampling state.

    Attributes:
      items: pytree of arrays ``[C, ...]`` (one transition per slot).
      priorities: ``[C] float32``, stored as ``(|p| + eps) ** alpha``; 0 marks an empty slot.
      position: ``int32`` scalar, the slot the next add writes first.
      size: ``int32`` scalar, slots filled so far (``<= C``).
      max_priority: ``float32`` scalar, the largest stored priority ever written (starts at 1);
        new items without a priority get it, so each is sampled at least once with high odds.
    """

    items: Any
    priorities: jax.Array
    position: jax.Array
    size: jax.Array
    max_priority: jax.Array

    @property
    def capacity(self) -> int:
        return self.priorities.shape[0]


def init(example_item: Any, capacity: int) -> ReplayState:
    """Empty buffer of ``capacity`` slots shaped like ``example_item`` (one item, no batch axis)."""
    if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool) or capacity < 1:
        raise ConfigError(f"replay.capacity must be a positive integer, got {capacity!r}")
    if capacity >= 2**31:
        raise ConfigError(f"replay.capacity must be < 2**31 (int32 slot indices), got {capacity}")
    capacity = int(capacity)
    leaves = jax.tree.leaves(example_item)
    if not leaves:
        raise ValueError("replay.init: example_item has no array leaves")

    def zeros(x):
        x = jnp.asarray(x)
        return jnp.zeros((capacity,) + x.shape, x.dtype)

    return ReplayState(
        items=jax.tree.map(zeros, example_item),
        priorities=jnp.zeros((capacity,), jnp.float32),
        position=jnp.zeros((), jnp.int32),
        size=jnp.zeros((), jnp.int32),
        max_priority=jnp.ones((), jnp.float32),
    )


def bytes_per_item(example_item: Any, include_priority: bool = True) -> int:
    """Bytes one slot occupies: the item's leaves (plus the float32 priority by default)."""
    total = sum(int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(jnp.asarray(x).dtype).itemsize
                for x in jax.tree.leaves(example_item))
    return total + (4 if include_priority else 0)


def transform_priorities(priorities: jax.Array, alpha, eps: float = _DEFAULT_EPS) -> jax.Array:
    """Stored form of raw priorities (e.g. per-sample losses): ``max((|p| + eps) ** alpha, tiny)``.

    ``alpha = 0`` gives exactly 1 for every finite ``p``. The floor keeps a stored priority
    positive (an exact 0 means an empty slot). Shapes: ``[n] -> [n] float32``.
    """
    p = jnp.abs(jnp.asarray(priorities, jnp.float32)) + jnp.float32(eps)
    return jnp.maximum(jnp.power(p, jnp.asarray(alpha, jnp.float32)), jnp.float32(_TINY))


def _leading_dim(state: ReplayState, items: Any) -> int:
    """Checks ``items`` against the buffer's structure; returns the common leading axis ``n``."""
    buf_leaves, buf_def = jax.tree.flatten(state.items)
    leaves, tree_def = jax.tree.flatten(items)
    if tree_def != buf_def:
        raise ValueError(f"replay.add: items structure {tree_def} differs from the buffer's "
                         f"{buf_def}")
    sizes = set()
    for k, (buf, x) in enumerate(zip(buf_leaves, leaves)):
        if x.shape[1:] != buf.shape[1:] or x.dtype != buf.dtype:
            raise ValueError(f"replay.add: leaf {k} is {x.dtype}{list(x.shape)}, the buffer "
                             f"stores {buf.dtype}[n, {', '.join(map(str, buf.shape[1:]))}]")
        sizes.add(x.shape[0] if x.ndim else None)
    if len(sizes) != 1 or None in sizes:
        raise ValueError("replay.add: leaves disagree on the leading (batch) axis: "
                         f"{sorted(sizes, key=str)}")
    return sizes.pop()


def add(state: ReplayState, items: Any, priorities: jax.Array | None = None, alpha=None,
        eps: float = _DEFAULT_EPS) -> ReplayState:
    """Writes ``n`` items at slots ``position .. position + n - 1`` (mod ``C``), oldest overwritten.

    Args:
      state: the buffer.
      items: pytree like the example item with a leading axis ``[n, ...]``; ``1 <= n <= C``.
      priorities: ``[n]`` raw priorities (e.g. TD losses), stored as ``(|p| + eps) ** alpha``;
        ``None`` gives every new item the current ``max_priority``.
      alpha: priority exponent (needed when ``priorities`` is given).
      eps: added to raw priorities so none is 0.

    Returns the new state; ``position`` advances by ``n`` (mod ``C``), ``size`` saturates at ``C``.
    """
    cap = state.capacity
    n = _leading_dim(state, items)
    if n > cap:
        raise ConfigError(f"replay.capacity {cap} is smaller than the {n} transitions added at "
                          f"once (one epoch); raise replay.capacity")
    if n == 0:
        return state
    # Distinct slots (n <= C), so one scatter per leaf with unique indices, wrap-around included.
    idx = (state.position + jnp.arange(n, dtype=jnp.int32)) % cap
    new_items = jax.tree.map(lambda buf, x: buf.at[idx].set(x, unique_indices=True),
                             state.items, items)
    if priorities is None:
        stored = jnp.broadcast_to(state.max_priority, (n,))
        max_priority = state.max_priority
    else:
        if alpha is None:
            raise ValueError("replay.add: priorities given without alpha")
        if jnp.shape(priorities) != (n,):
            raise ValueError(f"replay.add: priorities shape {jnp.shape(priorities)} != ({n},)")
        stored = transform_priorities(priorities, alpha, eps)
        max_priority = jnp.maximum(state.max_priority, jnp.max(stored))
    return state.replace(
        items=new_items,
        priorities=state.priorities.at[idx].set(stored, unique_indices=True),
        position=((state.position + n) % cap).astype(jnp.int32),
        size=jnp.minimum(state.size + n, cap).astype(jnp.int32),
        max_priority=max_priority,
    )


def block_size(capacity: int) -> int:
    """``S``, the slots per block of the two-level search: a power of two.

    Near ``sqrt(C)`` but at most 256, which keeps the per-draw work (a row of ``S``) small; and at
    least ``C / 4096``, which keeps the block count at most 4096, so that float32 block
    boundaries stay within ~5e-4 of a block's mass (the spacing of float32 at the total is
    ``2**-23`` of it, i.e. ``blocks * 2**-23`` of one block).
    """
    c = max(int(capacity), 2)
    near_sqrt = min(_MAX_BLOCK, 2 ** math.ceil(math.log2(c) / 2))
    return int(max(near_sqrt, 2 ** math.ceil(math.log2(-(-c // _MAX_BLOCKS)))))


def _last_positive(cum: jax.Array) -> jax.Array:
    """Index of the last entry with positive mass: the first where ``cum`` reaches its total.

    ``cum [..., k]`` is a non-decreasing cumulative sum; returns ``[...] int32``.
    """
    return jnp.argmax(cum >= cum[..., -1:], axis=-1).astype(jnp.int32)


def _block_masses(priorities: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[C] -> (blocks [C/S, S], block_mass [C/S])``, zero-padding the last block."""
    cap = priorities.shape[0]
    s = block_size(cap)
    nb = -(-cap // s)
    p = priorities if nb * s == cap else jnp.pad(priorities, (0, nb * s - cap))
    blocks = p.reshape(nb, s)
    return blocks, jnp.sum(blocks, axis=1)


def _count_at_or_below(cum: jax.Array, u: jax.Array, count_max: int = 0) -> jax.Array:
    """How many entries of the non-decreasing ``cum [k]`` are ``<= u``, for each of ``u [M]``:
    ``searchsorted(cum, u, side="right")`` as ``[M]`` int32.

    Up to ``count_max`` pairs (``ReplaySearch.count_max``), one ``[M, k]`` compare-and-count:
    one kernel, where a binary search is ~log2(k) small dependent ones, which pays on a GPU.
    Otherwise an unrolled binary search (the while-loop form costs a launch per step on a GPU),
    which a CPU, where the work counts rather than the launches, runs faster. Both give the
    same counts.
    """
    if u.shape[0] * cum.shape[0] <= count_max:
        return jnp.sum(cum[None, :] <= u[:, None], axis=1, dtype=jnp.int32)
    return jnp.searchsorted(cum, u, side="right", method="scan_unrolled").astype(jnp.int32)


def _pick(cum: jax.Array, walk: jax.Array) -> jax.Array:
    """The entry of each row of ``cum [M, k]`` (non-decreasing) whose interval holds
    ``walk [M]``: ``searchsorted(side="right")`` as ``[M] int32``, never an entry of zero mass."""
    j = jnp.sum(cum <= walk[:, None], axis=1, dtype=jnp.int32)
    return jnp.minimum(j, _last_positive(cum))


_SUB_BLOCK = 32  # slots of a sub-block (ReplaySearch.whole_blocks_max)


def _slot_in_block(blocks: jax.Array, b: jax.Array, v: jax.Array,
                   whole_blocks_max: int) -> jax.Array:
    """``[M] int32``: the slot inside block ``b [M]`` of ``blocks [C/S, S]`` at fraction
    ``v [M]`` of the block's mass (inverse CDF of the block's own cumulative sum).

    ``M * S`` up to ``whole_blocks_max``: one ``[M, S]`` cumulative sum. Larger: the sub-block
    of ``T`` slots by the
    block's cumulative sub-block masses, then the slot inside it (the same slot in exact
    arithmetic; M rows of ``S/T + T`` entries instead of ``S``).
    """
    nb, s = blocks.shape
    m = b.shape[0]
    if m * s <= whole_blocks_max or s <= _SUB_BLOCK:
        local = jnp.cumsum(blocks[b], axis=1)  # [M, S]
        return _pick(local, v * local[:, -1])
    t, per = _SUB_BLOCK, s // _SUB_BLOCK
    sub_cum = jnp.cumsum(jnp.sum(blocks.reshape(nb, per, t), axis=2)[b], axis=1)  # [M, S/T]
    walk = v * sub_cum[:, -1]
    c = _pick(sub_cum, walk)
    before = jnp.take_along_axis(sub_cum, jnp.maximum(c - 1, 0)[:, None], axis=1)[:, 0]
    local = jnp.cumsum(blocks.reshape(nb * per, t)[b * per + c], axis=1)  # [M, T]
    return c * t + _pick(local, walk - jnp.where(c > 0, before, 0.0))


def _locate(blocks: jax.Array, cum: jax.Array, u: jax.Array, v: jax.Array,
            search: ReplaySearch) -> jax.Array:
    """Two-level inverse CDF.

    ``blocks [C/S, S]`` priorities, ``cum [C/S]`` cumulative block masses, ``u [M]`` in
    ``[0, cum[-1])`` picks the block, ``v [M]`` in ``[0, 1)`` the slot inside it (as a fraction of
    the block's mass); ``search`` the device's search shape. Returns ``[M] int32`` slot indices.
    """
    b = jnp.minimum(_count_at_or_below(cum, u, search.count_max), _last_positive(cum))
    return b * blocks.shape[1] + _slot_in_block(blocks, b, v, search.whole_blocks_max)


def locate(priorities: jax.Array, u: jax.Array, v: jax.Array,
           search: ReplaySearch = ReplaySearch()) -> jax.Array:
    """Inverse CDF of ``priorities`` in two levels: block by ``u``, slot in the block by ``v``.

    Block ``b`` covers ``[c_{b-1}, c_b)`` of the cumulative block masses ``c``, and inside it
    slot ``i`` covers ``[l_{i-1}, l_i) / l_S`` of the block's own cumulative sum ``l``. Zero-mass
    blocks and slots are never returned (a ``u`` at or past the total maps to the last block with
    mass). With ``u`` and ``v`` independent uniforms, ``P(i) = q_i / sum_j q_j``.

    Args:
      priorities: ``[C] float32``, non-negative, with some positive mass.
      u: ``[M] float32`` in ``[0, total)``.
      v: ``[M] float32`` in ``[0, 1)``.

    Returns ``[M] int32`` slot indices.
    """
    blocks, mass = _block_masses(priorities)
    u, v = jnp.asarray(u, jnp.float32), jnp.asarray(v, jnp.float32)
    return _locate(blocks, jnp.cumsum(mass), u, v, search)


def sample(state: ReplayState, key: jax.Array, batch_size: int, beta,
           search: ReplaySearch = ReplaySearch()) -> tuple[Any, jax.Array, jax.Array]:
    """Stratified proportional draw of ``M = batch_size`` items with importance weights.

    The total mass is cut into ``M`` equal segments and one uniform point is drawn in each
    (Schaul et al. 2016) to choose a block; a second uniform places the draw inside the block's
    own mass. So ``P(i) = q_i / sum_j q_j`` over the ``size`` filled slots, with float32 error
    relative to each block's mass instead of the whole buffer's. Precondition: ``size >= 1``
    (an empty buffer returns slot 0 and non-finite weights).

    Args:
      state: the buffer.
      key: PRNG key.
      batch_size: ``M`` (static).
      beta: importance-sampling exponent in ``[0, 1]``.
      search: how the slot search runs on this device (``Tuning.replay``, static); it changes
        the speed, not the draw.

    Returns:
      items ``[M, ...]``, indices ``[M] int32``, weights ``[M] float32`` equal to
      ``(size * P(i)) ** -beta / max_batch (size * P(j)) ** -beta``.
    """
    items, indices, w = _draw(state, key, int(batch_size), beta, search)
    return items, indices, w / jnp.max(w)


def _draw(state: ReplayState, key: jax.Array, m: int, beta,
          search: ReplaySearch) -> tuple[Any, jax.Array, jax.Array]:
    """:func:`sample` before the weights are divided by their batch maximum."""
    k_u, k_v = jax.random.split(key)
    blocks, mass = _block_masses(state.priorities)
    cum = jnp.cumsum(mass)
    total = cum[-1]
    strata = jnp.arange(m, dtype=jnp.float32) + jax.random.uniform(k_u, (m,), jnp.float32)
    u = strata * (total / m)  # one point in each of M equal segments of the mass
    indices = _locate(blocks, cum, u, jax.random.uniform(k_v, (m,), jnp.float32), search)
    items = jax.tree.map(lambda x: x[indices], state.items)
    prob = state.priorities[indices] / total
    w = jnp.power(state.size.astype(jnp.float32) * prob, -jnp.asarray(beta, jnp.float32))
    return items, indices, w


def update_priorities(state: ReplayState, indices: jax.Array, priorities: jax.Array, alpha,
                      eps: float = _DEFAULT_EPS) -> ReplayState:
    """Sets the priorities of sampled slots from raw values (e.g. per-sample losses).

    Stores ``(|p| + eps) ** alpha`` and raises ``max_priority`` to the largest new value. When an
    index repeats in the batch the last occurrence wins, deterministically on every backend (XLA
    leaves duplicate scatter order unspecified, so earlier duplicates are dropped first).
    Indices outside ``[0, C)`` are ignored.

    Args: indices ``[M] int32``, priorities ``[M]``, alpha exponent, eps offset.
    """
    indices = jnp.asarray(indices, jnp.int32)
    stored = transform_priorities(priorities, alpha, eps)
    if indices.shape != stored.shape or indices.ndim != 1:
        raise ValueError(f"replay.update_priorities: indices {indices.shape} and priorities "
                         f"{stored.shape} must be equal 1-D shapes")
    m, cap = indices.shape[0], state.capacity
    order = jnp.argsort(indices, stable=True)  # equal indices stay in batch order
    sorted_idx = indices[order]
    is_last = jnp.concatenate([sorted_idx[1:] != sorted_idx[:-1], jnp.ones((min(m, 1),), bool)])
    in_range = (sorted_idx >= 0) & (sorted_idx < cap)
    # Dropped writes go to slot C (out of range); a negative index would wrap, so it goes there too.
    target = jnp.where(is_last & in_range, sorted_idx, cap)
    new = state.priorities.at[target].set(stored[order], mode="drop")
    top = jnp.max(jnp.where(in_range, stored[order], 0.0), initial=0.0)
    return state.replace(priorities=new, max_priority=jnp.maximum(state.max_priority, top))


# --- sharded buffers (foxhunt_jax.parallel): S independent rings behind one leading axis ---------
#
# A sharded state has every leaf with a leading shard axis: items [S, C/S, ...], priorities
# [S, C/S], position/size/max_priority [S]. Shard s is an ordinary buffer; a global batch of M is
# M/S items drawn from each shard by its own prioritized sampling, with key fold_in(key, s).

def _per_shard(total: int, shards: int, what: str) -> int:
    if shards < 1 or total % shards:
        raise ConfigError(f"{what} {total} must be a multiple of train.shards ({shards})")
    return total // shards


def init_shards(example_item: Any, capacity: int, shards: int) -> ReplayState:
    """``shards`` empty rings of ``capacity / shards`` slots each (leaves ``[S, C/S, ...]``)."""
    one = init(example_item, _per_shard(int(capacity), int(shards), "replay.capacity"))
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (shards,) + x.shape), one)


def num_shards(state: ReplayState) -> int | None:
    """``S`` of a sharded state, None for a plain one (priorities ``[C]``)."""
    return state.priorities.shape[0] if state.priorities.ndim == 2 else None


def add_shards(state: ReplayState, items: Any, priorities: jax.Array | None = None, alpha=None,
               eps: float = _DEFAULT_EPS) -> ReplayState:
    """:func:`add` on every shard: ``items [S, n, ...]`` and ``priorities [S, n]``."""
    s, cap = state.priorities.shape
    n = jax.tree.leaves(items)[0].shape[1]
    if n > cap:
        raise ConfigError(f"replay.capacity {s * cap} holds {cap} slots per shard, fewer than the "
                          f"{n} transitions a shard adds at once (one epoch); raise "
                          "replay.capacity")
    if priorities is None:
        return jax.vmap(lambda st, it: add(st, it))(state, items)
    return jax.vmap(lambda st, it, p: add(st, it, p, alpha, eps))(state, items, priorities)


def sample_shards(state: ReplayState, key: jax.Array, batch_size: int, beta,
                  search: ReplaySearch = ReplaySearch()) -> tuple[Any, jax.Array, jax.Array]:
    """A global batch of ``M = batch_size``: ``M/S`` stratified draws from each shard.

    Shard ``s`` samples like :func:`sample` (``search`` likewise) with key ``fold_in(key, s)``.
    Its importance weight
    ``(size_s * P_s(i)) ** -beta`` equals the global one ``(S size_s * P_s(i) / S) ** -beta``
    (every shard holds the same count and gives ``M/S`` of the batch), and the weights are divided
    by their maximum over the whole batch.

    Returns items ``[S, M/S, ...]``, indices ``[S, M/S] int32`` (slots of each shard), weights
    ``[S, M/S] float32``.
    """
    s = state.priorities.shape[0]
    m = _per_shard(int(batch_size), s, "train.batch_size")
    items, indices, w = jax.vmap(lambda st, k: _draw(st, k, m, beta, search))(
        state, shard_keys(key, s))
    return items, indices, w / jnp.max(w)


def update_priorities_shards(state: ReplayState, indices: jax.Array, priorities: jax.Array, alpha,
                             eps: float = _DEFAULT_EPS) -> ReplayState:
    """:func:`update_priorities` on every shard: ``indices, priorities [S, m]``."""
    return jax.vmap(lambda st, i, p: update_priorities(st, i, p, alpha, eps))(
        state, indices, priorities)


# Jitted variants. The state argument is donated so the buffer is updated in place (without it
# every add would copy all C slots). Donation works on CPU too in jax 0.10; after a call the
# donated state must not be used again (`state = add_jit(state, ...)`).
add_jit = jax.jit(add, donate_argnums=0)
sample_jit = jax.jit(sample, static_argnames=("batch_size", "search"))
update_priorities_jit = jax.jit(update_priorities, donate_argnums=0)

__all__ = [
    "ReplayState", "init", "add", "sample", "update_priorities", "locate", "block_size",
    "transform_priorities", "bytes_per_item", "add_jit", "sample_jit", "update_priorities_jit",
    "init_shards", "num_shards", "add_shards", "sample_shards", "update_priorities_shards",
]
