"""The ``replay`` section: the replay buffer beside flashbax's prioritised item buffer.

Times, on whatever device JAX picks:

- ``add n``: write ``n`` transitions (102,400 = one epoch of N=1024 x L=100, and 64);
- ``sample M``: a prioritized batch of ``M`` with importance weights (64 and 4096);
- ``update M``: set ``M`` priorities (64 and 4096),

at each capacity, for :mod:`foxhunt_jax.agent.replay` and ``flashbax.make_prioritised_item_buffer``
holding the same item: the compact trading transition (bar + portfolio for s and s', actions,
n-step return, discount). Every function is jitted; functions that return the buffer donate it
(both libraries), so both update in place. Each figure is the median of ``repeats`` timed calls
after ``warmup`` untimed ones, each call followed by ``block_until_ready``. Buffers are filled
to capacity first. Both add without explicit priorities (new items get the running maximum, the
only mode flashbax's add has); flashbax's sample returns probabilities, so the importance weights
are computed from them inside its timed function, as ours does. Without flashbax installed, this
buffer alone is timed.
"""

from __future__ import annotations

import datetime
import importlib.util
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from foxhunt_jax.agent import replay
from foxhunt_jax.bench.common import Deadline


ALPHA, BETA = 0.6, 0.4


def trading_item(portfolio_dim: int = 6, branches: int = 3) -> dict:
    """One compact trading transition (no batch axis): 80 bytes per slot with its priority."""
    enc = {"bar": jnp.zeros((), jnp.int32), "portfolio": jnp.zeros((portfolio_dim,), jnp.float32)}
    return {"obs": enc, "next_obs": dict(enc), "action": jnp.zeros((branches,), jnp.int32),
            "reward": jnp.zeros((), jnp.float32), "discount": jnp.zeros((), jnp.float32)}


def random_items(example: Any, n: int, rng: np.random.Generator) -> Any:
    """``n`` random transitions shaped like ``example``, on the default device."""
    def leaf(x):
        shape = (n,) + x.shape
        if jnp.issubdtype(x.dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, 3, shape), x.dtype)
        return jnp.asarray(rng.standard_normal(shape), x.dtype)
    return jax.tree.map(leaf, example)


def median_ms(step: Callable[[Any], Any], carry: Any, repeats: int, warmup: int,
              stateful: bool) -> tuple[float, Any]:
    """Median wall time of ``step`` in ms; a stateful step's output feeds the next call."""
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        out = step(carry)
        jax.block_until_ready(out)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        if stateful:
            carry = out
    return statistics.median(times), carry


class Ours:
    """:mod:`foxhunt_jax.agent.replay` behind the interface :func:`bench_one` times."""

    name = "ours"

    def __init__(self, example: Any, capacity: int):
        self.capacity = capacity
        self.state = replay.init(example, capacity)

    def add(self, state, items):
        return replay.add_jit(state, items)

    def sample_fn(self, m: int):
        return lambda state, key: replay.sample_jit(state, key, m, BETA)

    def update(self, state, indices, priorities):
        return replay.update_priorities_jit(state, indices, priorities, ALPHA)


class Flashbax:
    """flashbax's prioritised item buffer behind the interface :func:`bench_one` times."""

    name = "flashbax"

    def __init__(self, example: Any, capacity: int, batch_sizes: tuple[int, ...]):
        import flashbax as fbx  # optional: a test dependency, not the library's

        platform = jax.default_backend()
        device = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}.get(platform, "cpu")
        self.capacity = capacity
        # sample_batch_size is fixed per buffer object; the state is shared between them.
        self.buffers = {m: fbx.make_prioritised_item_buffer(
            max_length=capacity, min_length=1, sample_batch_size=m, add_batches=True,
            priority_exponent=ALPHA, device=device) for m in batch_sizes if m <= capacity}
        base = next(iter(self.buffers.values()))
        # Strong dtypes: flashbax's init leaves weakly typed scalars that the first add turns
        # strong, which would compile every function twice.
        self.state = jax.tree.map(lambda x: jnp.asarray(x, dtype=x.dtype), base.init(example))
        self._add = jax.jit(base.add, donate_argnums=0)
        self._update = jax.jit(base.set_priorities, donate_argnums=0)
        self._sample = {m: jax.jit(self._sample_with_weights(b)) for m, b in self.buffers.items()}

    def _sample_with_weights(self, buffer):
        cap = self.capacity

        def fn(state, key):
            batch = buffer.sample(state, key)
            size = jnp.minimum(state.running_index, cap).astype(jnp.float32)
            w = jnp.power(size * batch.probabilities, -BETA)
            return batch.experience, batch.indices, w / jnp.max(w)
        return fn

    def add(self, state, items):
        return self._add(state, items)

    def sample_fn(self, m: int):
        return self._sample[m]

    def update(self, state, indices, priorities):
        return self._update(state, indices, priorities)


def bench_one(impl, example, add_sizes, batch_sizes, repeats, warmup,
              rng) -> dict[str, float | None]:
    """Fills ``impl``'s buffer, then times every op; returns ``{op: ms or None when n > C}``.

    Sizes above the capacity are skipped for both buffers (flashbax refuses them).
    """
    cap = impl.capacity
    # Fill with the largest timed add size that fits, so filling compiles nothing extra.
    chunk = max([n for n in add_sizes if n <= cap], default=cap)
    fill = random_items(example, chunk, rng)
    state = impl.state
    for _ in range(-(-cap // chunk)):
        state = impl.add(state, fill)
    jax.block_until_ready(state)
    order = [f"add {n}" for n in add_sizes] + [f"{op} {m}" for op in ("sample", "update")
                                                for m in batch_sizes]
    out: dict[str, float | None] = dict.fromkeys(order)
    for n in add_sizes:
        if n > cap:
            out[f"add {n}"] = None
            continue
        items = random_items(example, n, rng)
        out[f"add {n}"], state = median_ms(lambda s: impl.add(s, items), state, repeats, warmup,
                                           stateful=True)
    # A fresh key per call, sliced before the clock starts.
    keys = list(jax.random.split(jax.random.key(int(rng.integers(1 << 31))), warmup + repeats))
    fitting = [m for m in batch_sizes if m <= cap]
    for m in fitting:
        fn, it = impl.sample_fn(m), iter(keys)
        out[f"sample {m}"], _ = median_ms(lambda s: fn(s, next(it)), state, repeats, warmup,
                                          stateful=False)
    for m in fitting:
        _, indices, _ = impl.sample_fn(m)(state, keys[0])
        prios = jnp.asarray(rng.gamma(1.0, 1.0, m), jnp.float32)
        out[f"update {m}"], state = median_ms(lambda s: impl.update(s, indices, prios), state,
                                              repeats, warmup, stateful=True)
    impl.state = None  # the last state was donated; drop references before the next capacity
    del state
    return out



def compare(capacities: tuple[int, ...], add_sizes: tuple[int, ...] = (102400, 64),
            batch_sizes: tuple[int, ...] = (64, 4096), repeats: int = 20, warmup: int = 2,
            seed: int = 0, use_flashbax: bool = True) -> dict:
    """Both buffers at each capacity (:func:`bench_one`): ``rows`` of ``{capacity, op, ours_ms,
    flashbax_ms, ratio}`` (``ratio`` above 1: this buffer is faster; ``None`` where an op was
    not timed) with the device and settings."""
    if repeats < 1 or warmup < 1:
        raise ValueError("repeats and warmup must be >= 1 (the warm-up includes compiling)")
    if use_flashbax and importlib.util.find_spec("flashbax") is None:
        print("  flashbax is not installed: timing this buffer only", flush=True)
        use_flashbax = False
    example = trading_item()
    rng = np.random.default_rng(seed)
    rows = []
    for cap in capacities:
        t0 = time.perf_counter()
        ours = bench_one(Ours(example, cap), example, add_sizes, batch_sizes, repeats, warmup,
                         rng)
        theirs = (bench_one(Flashbax(example, cap, batch_sizes), example, add_sizes, batch_sizes,
                            repeats, warmup, rng) if use_flashbax else {})
        for op, ms in ours.items():
            other = theirs.get(op)
            ratio = other / ms if (ms and other is not None) else None
            rows.append({"capacity": cap, "op": op, "ours_ms": ms, "flashbax_ms": other,
                         "ratio": ratio})
        print(f"  replay capacity {cap:,}: {time.perf_counter() - t0:.1f} s", flush=True)
    devs = jax.devices()
    return {"device": f"{devs[0].platform} ({getattr(devs[0], 'device_kind', devs[0].platform)})"
                      f" x{len(devs)}, jax {jax.__version__}",
            "backend": jax.default_backend(), "jax": jax.__version__,
            "date": datetime.date.today().isoformat(), "repeats": repeats, "warmup": warmup,
            "alpha": ALPHA, "beta": BETA, "flashbax": use_flashbax,
            "bytes_per_item": replay.bytes_per_item(example), "rows": rows}


def section_replay(args, out: dict, deadline: Deadline) -> None:
    """:func:`compare` at ``--replay-capacities`` (``--quick``: one tiny capacity)."""
    if args.quick:
        out.update(compare((2 ** 10,), add_sizes=(256, 64), batch_sizes=(16,), repeats=2,
                           warmup=1, seed=args.seed))
    else:
        out.update(compare(args.replay_capacities, repeats=args.replay_repeats,
                           seed=args.seed))
