"""Benchmark of the replay buffer against flashbax's prioritised item buffer.

Times, on whatever device JAX picks (CPU or GPU, unchanged code):

- ``add n``: write ``n`` transitions (102,400 = one epoch of N=1024 x L=100, and 64);
- ``sample M``: a prioritized batch of ``M`` with importance weights (64 and 4096);
- ``update M``: set ``M`` priorities (64 and 4096),

at each capacity, for ``foxhunt_jax.agent.replay`` and ``flashbax.make_prioritised_item_buffer``
holding the same item: the compact trading transition (bar + portfolio for s and s', actions,
n-step return, discount). Every function is jitted; functions that return the buffer donate it
(both libraries), so both update in place. Each figure is the median of ``--repeats`` timed calls
after ``--warmup`` untimed ones, each call followed by ``block_until_ready``. Buffers are filled
to capacity first. Both add without explicit priorities (new items get the running maximum, the
only mode flashbax's add has); flashbax's sample returns probabilities, so the importance weights
are computed from them inside its timed function, as ours does.

Usage::

    python scripts/bench_replay.py                       # capacities 2^16 2^18 2^20 2^22
    python scripts/bench_replay.py --quick               # CPU-friendly: 2^16 2^18
    python scripts/bench_replay.py --capacities 2^20,4194304 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from foxhunt_jax.agent import replay  # noqa: E402

ALPHA, BETA = 0.6, 0.4
DEFAULT_CAPACITIES = (2**16, 2**18, 2**20, 2**22)
QUICK_CAPACITIES = (2**16, 2**18)


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


def parse_capacities(text: str) -> tuple[int, ...]:
    """``"2^16,262144,2**20"`` -> ``(65536, 262144, 1048576)``."""
    out = []
    for tok in text.split(","):
        tok = tok.strip().replace("**", "^")
        if not tok:
            continue
        try:
            value = 2 ** int(tok[2:]) if tok.startswith("2^") else int(tok)
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot read '{tok}' (use 65536 or 2^16)") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"capacity must be >= 1, got {value}")
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError("no capacity given")
    return tuple(out)


def parse_sizes(text: str, flag: str) -> tuple[int, ...]:
    try:
        out = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise SystemExit(f"error: {flag}: expected comma-separated integers, got '{text}'") \
            from None
    if not out or min(out) < 1:
        raise SystemExit(f"error: {flag}: expected positive integers, got '{text}'")
    return out


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
    name = "flashbax"

    def __init__(self, example: Any, capacity: int, batch_sizes: tuple[int, ...]):
        import flashbax as fbx

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


def device_description() -> str:
    devs = jax.devices()
    d = devs[0]
    kind = getattr(d, "device_kind", d.platform)
    return f"{d.platform} ({kind}) x{len(devs)}, jax {jax.__version__}"


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def table(rows: list[dict]) -> str:
    lines = ["| capacity | op | ours ms | flashbax ms | flashbax / ours |",
             "| ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['capacity']:,} | {r['op']} | {fmt(r['ours_ms'])} | "
                     f"{fmt(r['flashbax_ms'])} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capacities", type=parse_capacities, default=None,
                    help="comma-separated, e.g. 2^16,2^18 or 65536 (default 2^16,2^18,2^20,2^22)")
    ap.add_argument("--quick", action="store_true", help="capacities 2^16,2^18 only")
    ap.add_argument("--add-sizes", default="102400,64",
                    help="transitions per add (default 102400,64)")
    ap.add_argument("--batch-sizes", default="64,4096",
                    help="sample/update batches (default 64,4096)")
    ap.add_argument("--repeats", type=int, default=20,
                    help="timed calls per op (median; default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls first, incl. compile")
    ap.add_argument("--no-flashbax", action="store_true", help="time this buffer only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 1:
        raise SystemExit("error: --repeats and --warmup must be >= 1 (warm-up includes compiling)")
    capacities = args.capacities or (QUICK_CAPACITIES if args.quick else DEFAULT_CAPACITIES)
    add_sizes = parse_sizes(args.add_sizes, "--add-sizes")
    batch_sizes = parse_sizes(args.batch_sizes, "--batch-sizes")
    use_fbx = not args.no_flashbax
    if use_fbx:
        try:
            import flashbax  # noqa: F401
        except ImportError:
            print("flashbax is not installed: timing this buffer only", file=sys.stderr)
            use_fbx = False

    device = device_description()
    print(f"device: {device}", flush=True)
    example = trading_item()
    print(f"item: {replay.bytes_per_item(example)} bytes per slot incl. priority", flush=True)
    rng = np.random.default_rng(args.seed)
    rows = []
    for cap in capacities:
        t0 = time.perf_counter()
        ours = bench_one(Ours(example, cap), example, add_sizes, batch_sizes, args.repeats,
                         args.warmup, rng)
        theirs = (bench_one(Flashbax(example, cap, batch_sizes), example, add_sizes, batch_sizes,
                            args.repeats, args.warmup, rng) if use_fbx else {})
        for op, ms in ours.items():
            other = theirs.get(op)
            ratio = other / ms if (ms and other is not None) else None
            rows.append({"capacity": cap, "op": op, "ours_ms": ms, "flashbax_ms": other,
                         "ratio": ratio})
        print(f"capacity {cap:,}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(table(rows))
    result = {"device": device, "backend": jax.default_backend(), "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "argv": list(argv or sys.argv[1:]),
              "repeats": args.repeats, "warmup": args.warmup, "alpha": ALPHA, "beta": BETA,
              "bytes_per_item": replay.bytes_per_item(example), "rows": rows}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
