"""The ``device`` section: the ceilings the other figures are read against: GEMM rates (bf16;
f32 as the library runs it, ``network.F32_PRECISION``; f32 with ``Precision.HIGHEST``; default
f32), device-to-device copy bandwidth, and the cost of one ``lax.scan`` iteration (plain, and on
a GPU with the library's command buffers, which hold the while loop)."""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

from foxhunt_jax.agent.network import F32_PRECISION
from foxhunt_jax.bench.common import Deadline, time_calls
from foxhunt_jax.jitcache import COMMAND_BUFFER_KINDS, COMMAND_BUFFER_OPTION


def section_device(args, out: dict, deadline: Deadline) -> None:
    """GEMM rates, copy bandwidth and the per-iteration cost of a lax.scan."""
    n = 512 if args.quick else 8192
    reps = 3 if args.quick else 10
    key = jax.random.key(0)
    a = jax.random.normal(key, (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    gemm = {}
    # f32_bf16x6: the library's float32 GEMM algorithm from 1,024 rows (network.F32_PRECISION)
    for name, dt, prec in (("bf16", jnp.bfloat16, None),
                           ("f32_bf16x6", jnp.float32, F32_PRECISION),
                           ("f32_highest", jnp.float32, "highest"),
                           ("f32_default", jnp.float32, None)):
        f = jax.jit(lambda x, y, _d=dt, _p=prec: jnp.dot(x.astype(_d), y.astype(_d), precision=_p,
                                                         preferred_element_type=jnp.float32))
        m = n if name == "bf16" else n // 2  # f32 is much slower; keep the call short
        xa, xb = a[:m, :m], b[:m, :m]
        ms = statistics.median(time_calls(lambda: f(xa, xb), reps, warmup=5))
        gemm[name] = {"n": m, "ms": ms, "tflops": 2 * m ** 3 / (ms * 1e-3) / 1e12}
    out["gemm"] = gemm

    size = (1 << 22) if args.quick else (1 << 29)  # f32 elements: 2 GiB read, 2 GiB written
    x = jnp.ones((size,), jnp.float32) * 1.5
    copy = jax.jit(lambda v: v * 1.0001)
    ms = statistics.median(time_calls(lambda: copy(x), reps, warmup=5))
    out["copy"] = {"bytes_moved": 8 * size, "ms": ms, "gb_per_s": 8 * size / (ms * 1e-3) / 1e9}
    del x, a, b

    # one scan iteration: a trivial body over 1024 floats, L steps, per iteration
    steps = 100
    body = lambda c, _: (c * 1.0001 + 1.0, None)
    scan = lambda c: jax.lax.scan(body, c, None, length=steps)[0]
    c0 = jnp.ones((1024,), jnp.float32)
    res = {}
    variants = [("plain", None)]
    if jax.default_backend() == "gpu":
        variants.append(("command_buffer", {COMMAND_BUFFER_OPTION: COMMAND_BUFFER_KINDS,
                                            "xla_gpu_graph_min_graph_size": 1}))
    for name, opts in variants:
        try:
            f = jax.jit(scan, compiler_options=opts) if opts else jax.jit(scan)
            ms = statistics.median(time_calls(lambda: f(c0), reps * 3, warmup=2))
            res[name] = {"us_per_iteration": ms * 1e3 / steps, "ms_per_scan": ms}
        except Exception as e:  # an XLA build without these command types
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    out["scan"] = {"steps": steps, **res}

