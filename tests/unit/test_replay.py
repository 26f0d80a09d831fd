"""Replay buffer: ring semantics, proportional sampling, importance weights, priority updates.

Every check compares with an independent NumPy (float64) model of the same rules.
"""

from __future__ import annotations

import math
import statistics

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.agent import replay
from foxhunt_jax.bench.replay import compare as compare_replay
from foxhunt_jax.errors import ConfigError
from pallas_kernels.tuning import ReplaySearch

GPU_COUNT_MAX = 1 << 24  # the tuning table's compare-and-count bound on a GPU

ALPHA, EPS = 0.6, 1e-6
CAP, FILLED = 64, 50  # sampling tests share one buffer shape, so _many_samples compiles once


def example_item():
    return {"a": jnp.zeros((2,), jnp.float32), "b": {"c": jnp.zeros((), jnp.int8)}}


def random_batch(rng, n):
    return {"a": jnp.asarray(rng.standard_normal((n, 2)), jnp.float32),
            "b": {"c": jnp.asarray(rng.integers(-100, 100, n), jnp.int8)}}


class NumpyRing:
    """Reference ring buffer: writes one item at a time, oldest first overwritten."""

    def __init__(self, capacity):
        self.cap = capacity
        self.a = np.zeros((capacity, 2), np.float64)
        self.c = np.zeros(capacity, np.int64)
        self.q = np.zeros(capacity, np.float64)
        self.pos = self.size = 0
        self.max_q = 1.0

    def add(self, batch, priorities=None):
        a, c = np.asarray(batch["a"], np.float64), np.asarray(batch["b"]["c"], np.int64)
        q = (np.full(len(a), self.max_q) if priorities is None
             else (np.abs(np.asarray(priorities, np.float64)) + EPS) ** ALPHA)
        for k in range(len(a)):
            self.a[self.pos], self.c[self.pos], self.q[self.pos] = a[k], c[k], q[k]
            self.pos = (self.pos + 1) % self.cap
            self.size = min(self.size + 1, self.cap)
        self.max_q = max(self.max_q, q.max())


def critical_chi2(df: int, p: float = 0.001) -> float:
    """Upper ``p`` critical value of chi-square: scipy if present, else Wilson-Hilferty."""
    try:
        from scipy.stats import chi2
        return float(chi2.ppf(1 - p, df))
    except ImportError:
        z = statistics.NormalDist().inv_cdf(1 - p)
        return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(np.sum((counts - expected) ** 2 / expected))


@jax.jit
def _many_samples(state, key, beta):
    """1e5 draws: 1000 independent stratified batches of 100."""
    keys = jax.random.split(key, 1000)
    return jax.vmap(lambda k: replay.sample(state, k, 100, beta))(keys)


def test_wilson_hilferty_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    z = statistics.NormalDist().inv_cdf(0.999)
    wh = 49 * (1 - 2 / (9 * 49) + z * math.sqrt(2 / (9 * 49))) ** 3
    assert abs(wh - scipy_stats.chi2.ppf(0.999, 49)) / wh < 0.01


def test_init_shapes_and_bytes():
    state = replay.init(example_item(), 5)
    chex.assert_shape(state.items["a"], (5, 2))
    chex.assert_type(state.items["b"]["c"], jnp.int8)
    chex.assert_shape(state.priorities, (5,))
    chex.assert_type([state.priorities, state.max_priority], jnp.float32)
    chex.assert_type([state.position, state.size], jnp.int32)
    assert state.capacity == 5 and int(state.size) == 0 and float(state.max_priority) == 1.0
    assert not np.any(np.asarray(state.priorities))

    enc = {"bar": np.zeros((), np.int32), "portfolio": np.zeros(6, np.float32)}
    trading = {"obs": enc, "next_obs": enc, "action": np.zeros(3, np.int32),
               "reward": np.zeros((), np.float32), "discount": np.zeros((), np.float32)}
    ref = sum(np.asarray(x).nbytes for x in jax.tree.leaves(trading))
    assert replay.bytes_per_item(trading, include_priority=False) == ref
    assert replay.bytes_per_item(trading) == ref + 4
    trading_i8 = dict(trading, action=np.zeros(3, np.int8))
    assert replay.bytes_per_item(trading_i8) == ref + 4 - 9
    full = {"obs": np.zeros(40, np.float32), "next_obs": np.zeros(40, np.float32),
            "action": np.zeros(3, np.int32), "reward": np.float32(0), "discount": np.float32(0)}
    assert replay.bytes_per_item(full) == 4 * (40 + 40 + 3 + 1 + 1) + 4


def test_bad_input_raises():
    with pytest.raises(ConfigError, match="replay.capacity"):
        replay.init(example_item(), 0)
    state = replay.init(example_item(), 4)
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="replay.capacity 4"):
        replay.add(state, random_batch(rng, 5))
    bad = random_batch(rng, 2)
    bad["a"] = bad["a"].astype(jnp.float16)
    with pytest.raises(ValueError, match="leaf 0"):
        replay.add(state, bad)
    with pytest.raises(ValueError, match="structure"):
        replay.add(state, {"a": bad["a"]})
    with pytest.raises(ValueError, match="alpha"):
        replay.add(state, random_batch(rng, 2), jnp.ones(2))


@pytest.mark.parametrize("seed", [0, 1])
def test_ring_wraparound_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    cap = 7
    state, ref = replay.init(example_item(), cap), NumpyRing(cap)
    # Two batch sizes (few compiles): 3 wraps mid-batch at various offsets, 7 = C rewrites all.
    for k, n in enumerate([3, 3, 7, 3, 7, 3, 3, 3, 7, 3]):
        batch = random_batch(rng, n)
        if k % 3 == 1:
            state = replay.add_jit(state, batch)
            ref.add(batch)
        else:
            p = rng.gamma(0.5, 2.0, n)
            state = replay.add_jit(state, batch, jnp.asarray(p, jnp.float32), ALPHA)
            ref.add(batch, p)
        assert int(state.position) == ref.pos and int(state.size) == ref.size
        np.testing.assert_array_equal(np.asarray(state.items["a"], np.float64), ref.a)
        np.testing.assert_array_equal(np.asarray(state.items["b"]["c"], np.int64), ref.c)
        np.testing.assert_allclose(np.asarray(state.priorities), ref.q, rtol=2e-6)
        np.testing.assert_allclose(float(state.max_priority), ref.max_q, rtol=2e-6)


@pytest.mark.parametrize("whole_blocks_max", [0, 1 << 40])
def test_locate_matches_float64_inverse_cdf(whole_blocks_max):
    """Two-level search vs exact float64 inverse CDF of both levels at C = 2^16, with the slot
    inside a block found in sub-blocks (max 0) and in one pass over the block (max 2^40)."""
    search = ReplaySearch(whole_blocks_max=whole_blocks_max)
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    cap = 1 << 16
    q = (rng.gamma(0.5, 1.0, cap) ** ALPHA).astype(np.float32)
    q[rng.random(cap) < 0.3] = 0  # empty slots inside blocks
    starts = rng.integers(0, cap - 64, 200)
    for a in starts:  # runs of empty slots: empty sub-blocks (and some empty blocks)
        q[a: a + int(rng.integers(32, 600))] = 0
    q[-1000:] = 0  # empty tail slots
    s = replay.block_size(cap)
    blocks = q.astype(np.float64).reshape(-1, s)
    cum = np.cumsum(blocks.sum(axis=1))
    m = 100_000
    u = (rng.random(m) * cum[-1]).astype(np.float32)
    v = rng.random(m).astype(np.float32)
    b = np.minimum(np.searchsorted(cum, u.astype(np.float64), side="right"), len(cum) - 1)
    local = np.cumsum(blocks[b], axis=1)
    ref = b * s + np.sum(local <= (v * local[:, -1])[:, None], axis=1)
    got = np.asarray(jax.jit(replay.locate, static_argnums=3)(jnp.asarray(q), jnp.asarray(u),
                                                              jnp.asarray(v), search))
    chex.assert_shape(got, (m,))
    assert got.dtype == np.int32
    assert np.all(q[got] > 0)  # never an empty slot
    assert np.mean(got != ref) < 1e-4


@pytest.mark.parametrize("count_max", [0, GPU_COUNT_MAX])
def test_block_search_equals_searchsorted(count_max):
    """Both forms of the block search (binary search; compare-and-count) give NumPy's
    searchsorted(side="right") exactly, ties, empty blocks and boundary points included."""
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    k, m = int(rng.integers(1, 600)), int(rng.integers(1, 300))
    mass = rng.gamma(0.5, 1.0, k).astype(np.float32)
    mass[rng.random(k) < 0.2] = 0  # empty blocks: equal neighbours in the cumulative sum
    cum = np.cumsum(mass).astype(np.float32)
    u = (rng.random(m) * cum[-1] * 1.1).astype(np.float32)
    u[: m // 3] = cum[rng.integers(0, k, m // 3)]  # exactly on a boundary
    got = np.asarray(jax.jit(replay._count_at_or_below, static_argnums=2)(
        jnp.asarray(cum), jnp.asarray(u), count_max))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.searchsorted(cum, u, side="right"))


def test_sample_draws_the_same_items_with_either_block_search():
    """The search shape (the device's tuning) changes how a sample searches, not what it
    draws."""
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    state = replay.init({"x": jnp.zeros((), jnp.float32)}, 1 << 12)
    state = replay.add(state, {"x": jnp.arange(1 << 12, dtype=jnp.float32)},
                       jnp.asarray(rng.gamma(0.5, 1.0, 1 << 12), jnp.float32), 0.6)
    key = jax.random.key(int(rng.integers(1 << 30)))
    draws = [jax.jit(replay.sample, static_argnums=(2, 4))(state, key, 64, 0.5, c)
             for c in (ReplaySearch(), ReplaySearch(count_max=GPU_COUNT_MAX, whole_blocks_max=0))]
    chex.assert_trees_all_equal(draws[0], draws[1])


def test_sampling_frequencies_and_weights_match_priorities():
    rng = np.random.default_rng(11)
    filled = FILLED  # CAP - FILLED empty slots must never be drawn
    raw = rng.gamma(0.7, 1.0, filled)
    state = replay.add_jit(replay.init(example_item(), CAP), random_batch(rng, filled),
                           jnp.asarray(raw, jnp.float32), ALPHA)
    beta = float(rng.uniform(0.3, 1.0))
    items, idx, w = _many_samples(state, jax.random.key(int(rng.integers(1 << 30))), beta)
    chex.assert_shape([idx, w], (1000, 100))
    chex.assert_shape(items["a"], (1000, 100, 2))
    chex.assert_type(idx, jnp.int32)
    chex.assert_type(w, jnp.float32)
    idx, w = np.asarray(idx), np.asarray(w, np.float64)
    assert idx.min() >= 0 and idx.max() < filled
    np.testing.assert_array_equal(np.asarray(items["a"]), np.asarray(state.items["a"])[idx])

    q = (raw + EPS) ** ALPHA
    probs = q / q.sum()
    counts = np.bincount(idx.ravel(), minlength=filled)
    assert chi2_stat(counts, probs) < critical_chi2(filled - 1)

    ref_w = (filled * probs[idx]) ** -beta
    ref_w /= ref_w.max(axis=1, keepdims=True)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5)


def test_update_priorities_changes_sampling():
    rng = np.random.default_rng(5)
    cap = FILLED
    state = replay.add_jit(replay.init(example_item(), CAP), random_batch(rng, cap))
    new_idx = rng.choice(cap, 20, replace=False)
    new_p = rng.gamma(1.0, 3.0, 20)
    state = replay.update_priorities_jit(state, jnp.asarray(new_idx, jnp.int32),
                                         jnp.asarray(new_p, jnp.float32), ALPHA)
    q = np.ones(cap)  # untouched slots keep max_priority = 1
    q[new_idx] = (new_p + EPS) ** ALPHA
    np.testing.assert_allclose(np.asarray(state.priorities)[:cap], q, rtol=2e-6)
    np.testing.assert_allclose(float(state.max_priority), max(1.0, q.max()), rtol=2e-6)
    _, idx, _ = _many_samples(state, jax.random.key(7), 0.5)
    counts = np.bincount(np.asarray(idx).ravel(), minlength=cap)
    assert chi2_stat(counts, q / q.sum()) < critical_chi2(cap - 1)
    assert chi2_stat(counts, np.full(cap, 1 / cap)) > critical_chi2(cap - 1)  # no longer uniform


def test_duplicate_indices_last_write_wins():
    state = replay.add_jit(replay.init(example_item(), 7),
                           random_batch(np.random.default_rng(0), 7))
    idx = jnp.asarray([3, 5, 3, 3, 5, 0, 9, -1], jnp.int32)  # 9 and -1 are out of range: ignored
    p = jnp.asarray([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 70.0, 80.0], jnp.float32)
    new = replay.update_priorities_jit(state, idx, p, 1.0, 0.0)
    got = np.asarray(new.priorities)
    assert got[3] == 4.0 and got[5] == 5.0 and got[0] == 6.0
    np.testing.assert_array_equal(got[[1, 2, 4, 6]], 1.0)
    assert float(new.max_priority) == 6.0


def test_alpha_zero_is_uniform():
    rng = np.random.default_rng(2)
    cap = FILLED
    raw = rng.gamma(0.3, 5.0, cap)
    state = replay.add_jit(replay.init(example_item(), CAP), random_batch(rng, cap),
                           jnp.asarray(raw, jnp.float32), 0.0)
    state = replay.update_priorities_jit(state, jnp.asarray(rng.choice(cap, 20), jnp.int32),
                                         jnp.asarray(rng.gamma(1.0, 9.0, 20), jnp.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(state.priorities)[:cap], 1.0)
    _, idx, w = _many_samples(state, jax.random.key(3), 1.0)
    np.testing.assert_array_equal(np.asarray(w), 1.0)
    counts = np.bincount(np.asarray(idx).ravel(), minlength=cap)
    assert chi2_stat(counts, np.full(cap, 1 / cap)) < critical_chi2(cap - 1)


def test_sampling_is_stratified():
    """Uniform mass, C = M: draw k lands in segment k of the mass, hence in block k // S."""
    cap = CAP
    state = replay.add_jit(replay.init(example_item(), cap),
                           random_batch(np.random.default_rng(1), cap))
    _, idx, _ = replay.sample_jit(state, jax.random.key(0), cap, 0.4)
    s = replay.block_size(cap)
    np.testing.assert_array_equal(np.asarray(idx) // s, np.arange(cap) // s)


def test_jit_with_donation():
    """The donating variants run, consume their input state and give the reference results."""
    rng = np.random.default_rng(4)
    ref = NumpyRing(7)
    first = random_batch(rng, 7)
    ref.add(first)
    state = replay.add_jit(replay.init(example_item(), 7), first)
    batch, p = random_batch(rng, 3), rng.gamma(1.0, 1.0, 3)
    old = state
    state = replay.add_jit(state, batch, jnp.asarray(p, jnp.float32), ALPHA)
    ref.add(batch, p)
    assert old.priorities.is_deleted() and old.items["a"].is_deleted()  # reused in place
    np.testing.assert_array_equal(np.asarray(state.items["a"], np.float64), ref.a)
    _, idx, _ = replay.sample_jit(state, jax.random.key(1), 8, 0.5)
    chex.assert_shape(idx, (8,))
    new_p = rng.gamma(1.0, 1.0, 8)
    state = replay.update_priorities_jit(state, idx, jnp.asarray(new_p, jnp.float32), ALPHA)
    for i, v in zip(np.asarray(idx), new_p):  # sequential writes: the last duplicate wins
        ref.q[i] = (v + EPS) ** ALPHA
    np.testing.assert_allclose(np.asarray(state.priorities), ref.q, rtol=2e-6)


def test_replay_comparison_times_both_buffers():
    result = compare_replay((2 ** 8,), add_sizes=(64, 512), batch_sizes=(64,), repeats=2,
                            warmup=1)
    ops = {r["op"]: r for r in result["rows"]}
    assert set(ops) == {"add 64", "add 512", "sample 64", "update 64"}
    assert ops["add 512"]["ours_ms"] is None  # larger than the capacity: skipped
    for op in ("add 64", "sample 64", "update 64"):
        assert ops[op]["ours_ms"] > 0 and ops[op]["flashbax_ms"] > 0


def test_transform_priorities_matches_numpy_and_never_empties_a_slot():
    rng = np.random.default_rng(8)
    p = rng.standard_normal(40) * 10.0 ** rng.integers(-8, 3, 40)
    for alpha in (0.0, 0.6, 1.0):
        got = np.asarray(replay.transform_priorities(jnp.asarray(p, jnp.float32), alpha, EPS))
        np.testing.assert_allclose(got, (np.abs(p.astype(np.float32)) + EPS) ** alpha, rtol=2e-6)
    # (1e-6 + eps) ** 10 underflows float32; the floor keeps the slot distinguishable from empty.
    tiny = replay.transform_priorities(jnp.zeros(3), 10.0, EPS)
    assert np.all(np.asarray(tiny) > 0)
