"""``foxhunt-jax bench``: speed of every phase on whatever device JAX runs on, in one run.

Sections (``--sections``, all by default, run in this order), over the backends (``xla``,
``pallas``) and precisions (``float32``, ``bfloat16``) side by side (``--variants``):

- ``seed``: the seed workload (``--config``, default ``configs/seed.yaml``) through the public
  :class:`~foxhunt_jax.training.trainer.Trainer` API: per-phase times of ``--epochs`` epochs
  after ``--warmup`` (median, quartiles, min, max), and each variant's compile in this process
  (the first with an empty cache; later ones reuse what earlier ones compiled, such as XLA's
  autotuning results).
- ``compile``: the whole epoch's compile per variant in fresh processes: cold (an empty cache
  folder of its own), then from the caches it filled (JAX's persistent cache; the executable
  cache).
- ``device``: the ceilings measured here: GEMM rate (bf16; f32 as the library runs it, bf16x6,
  ``network.F32_PRECISION``; f32 with ``Precision.HIGHEST``; default f32), device-to-device
  copy bandwidth, and the cost of one ``lax.scan`` iteration
  (plain, and with the library's command buffers, i.e. CUDA graphs, for the while loop).
- ``forward``: the collection/inference Q-forward (:func:`foxhunt_jax.agent.network.q_forward`)
  alone at ``--forward-n`` rows: time, rows/s, achieved FLOP/s, and equality of the Pallas
  kernel with the Flax forward on fresh random inputs (expected-Q error, greedy-action
  mismatches outside near-ties); each Pallas launch shape of ``--kernel-configs`` is timed
  (the float32 kernel, which lost and compiles for minutes on a GPU, only with
  ``--forward-f32-kernel``).
- ``collect``: collection throughput in env-steps/s at ``--collect-n`` episodes x L: the
  collection loop (``rollout``: Q-forward, epsilon-greedy, env step, curiosity bonus,
  auto-reset, the per-step transitions written out: the per-step work of
  :func:`foxhunt_jax.training.collect.collect`'s scan), and the whole experience phase
  (``collect`` + replay add) at ``--experience-n`` (its initial-priority pass holds
  ``[N*L, width]`` activations); at the largest N a breakdown without curiosity and without
  the Q-forward; with ``pallas`` among the variants, the rollout kernel's trajectory is
  compared with the scan's at the smallest N (same keys and parameters).
- ``train``: learner throughput: steps/s at the seed batch and samples/s at ``--big-batch``.
- ``replay``: add/sample/update beside flashbax (``scripts/bench_replay.py``).
- ``cmdbuf``: the seed epoch with XLA's default command buffers, which leave while loops out, in
  a fresh process: what the library's while-loop command buffers
  (:data:`foxhunt_jax.jitcache.COMMAND_BUFFER_KINDS`) buy.

Prints markdown tables and writes everything to ``--json`` (rewritten after every section, so
a run cut short keeps what it measured). ``--quick`` shrinks everything for a CPU check;
``--time-budget`` skips (and lists) work that would start too late. ``--merge A.json B.json``
measures nothing: it joins the JSONs of runs that split the sections between them (where a
command's time is limited) into one (:func:`merge`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import inspect
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from foxhunt_jax.errors import FoxhuntError
from foxhunt_jax.jitcache import COMMAND_BUFFER_KINDS, COMMAND_BUFFER_OPTION, compiler_options

REPO = Path(__file__).resolve().parent.parent
# in this order: the seed section compiles first, in this process
SECTIONS = ("seed", "compile", "device", "forward", "collect", "train", "replay", "cmdbuf")
# pallas:float32 is refused by the config (its kernel lost to XLA, BENCHMARKS.md); the forward
# section still times the float32 kernel itself
DEFAULT_VARIANTS = ("xla:float32", "xla:bfloat16", "pallas:bfloat16")
# XLA's own command-buffer kinds (without while loops and conditionals), which XLA_FLAGS sets
# over the library's option for the cmdbuf section's comparison
XLA_DEFAULT_KINDS = ",".join(k for k in COMMAND_BUFFER_KINDS.split(",")
                             if k not in ("WHILE", "CONDITIONAL"))
QUICK_OVERRIDES = ("network.trunk=[32]", "network.head=16", "env.episode_length=8",
                   "train.num_episodes=16", "train.train_steps=2", "train.batch_size=16",
                   "train.validation_windows=4", "replay.capacity=1024", "curiosity.hidden=16",
                   "curiosity.embed=8")
CMDBUF_FLAGS = f"--{COMMAND_BUFFER_OPTION}={XLA_DEFAULT_KINDS}"


# --- small helpers -----------------------------------------------------------------------------

def spread(values: list[float]) -> dict:
    """Median, quartiles, min and max of a sample (ms or any unit)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return {}
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "min": xs[0],
            "max": xs[-1], "n": len(xs)}


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Wall times in ms of ``fn()`` (each synchronized), after ``warmup`` untimed calls."""
    import jax

    out = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def parse_variants(text: str) -> tuple[tuple[str, str], ...]:
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        if not tok:
            continue
        backend, _, dtype = tok.partition(":")
        dtype = {"f32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
        if backend not in ("xla", "pallas") or dtype not in ("float32", "bfloat16"):
            raise argparse.ArgumentTypeError(f"variant '{tok}' must be xla|pallas:float32|bfloat16")
        if (backend, dtype) == ("pallas", "float32"):
            raise argparse.ArgumentTypeError("variant 'pallas:float32' is not a configuration (the"
                                             " config refuses it; the forward section times it)")
        out.append((backend, dtype))
    if not out:
        raise argparse.ArgumentTypeError("no variant given")
    return tuple(out)


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(float(t)) for t in text.replace("_", "").split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got '{text}'")
    return out


def parse_kernel_configs(text: str):
    """``"grouped:128:8,per_action:64:4:64,grouped:128:8:16:128:2"`` -> KernelConfigs
    (layout:block_rows:num_warps, then optionally min_rows, max_chunk (0: the dtype's widest)
    and lookahead)."""
    from pallas_kernels.q_forward import LAYOUTS
    from pallas_kernels.tuning import KernelConfig

    out = []
    for tok in text.split(","):
        tok = tok.strip()
        if not tok:
            continue
        parts = tok.split(":")
        if not 3 <= len(parts) <= 6 or parts[0] not in LAYOUTS:
            raise argparse.ArgumentTypeError(
                f"kernel config '{tok}' must be layout:rows:warps[:min_rows[:max_chunk"
                f"[:lookahead]]]")
        try:
            rows, warps, *rest = (int(x) for x in parts[1:])
        except ValueError:
            raise argparse.ArgumentTypeError(f"kernel config '{tok}': expected integers") from None
        min_rows, chunk, ahead = (rest + [16, 0, 0][len(rest):])
        if any(r < 16 or r & (r - 1) for r in (rows, min_rows)) or warps < 1 or ahead < 0:
            raise argparse.ArgumentTypeError(f"kernel config '{tok}': rows powers of 2 >= 16")
        out.append(KernelConfig(block_rows=rows, num_warps=warps, layout=parts[0],
                                min_rows=min_rows, max_chunk=chunk or None, lookahead=ahead))
    return tuple(out)


def kernel_config_name(kc) -> str:
    """The inverse of :func:`parse_kernel_configs` for one config (0 = the dtype's widest)."""
    return (f"{kc.layout}:{kc.block_rows}:{kc.num_warps}:{kc.min_rows}:{kc.max_chunk or 0}:"
            f"{kc.lookahead}")


def git_commit() -> str:
    """``git rev-parse --short HEAD`` (+ "with uncommitted changes"); ``FOXHUNT_BENCH_COMMIT``
    when the tree has no git metadata (a copy sent to a device machine)."""
    if os.environ.get("FOXHUNT_BENCH_COMMIT"):
        return os.environ["FOXHUNT_BENCH_COMMIT"]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not rev:
        return "unknown"
    return rev + (" with uncommitted changes" if dirty else "")


class Deadline:
    """The run's time budget: sections skip work that would start after it."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def ok(self, need: float = 0.0) -> bool:
        return self.left() > need


def _build_trainer(cfg, market):
    from foxhunt_jax.training.trainer import Trainer

    kwargs = {}
    if "devices" in inspect.signature(Trainer.build).parameters:
        import jax
        kwargs["devices"] = jax.devices()[:1]  # the single-device figures, whatever is visible
    return Trainer.build(cfg, market=market, **kwargs)


def _variant_cfg(args, backend: str, dtype: str, extra: list[str] = ()):
    from foxhunt_jax.config import load_config

    return load_config(args.config, list(args.overrides) + [f"network.backend={backend}",
                                                           f"network.dtype={dtype}", *extra])


_SHORT = {"float32": "f32", "bfloat16": "bf16"}
# seconds a section needs to be worth starting (the replay script has no budget of its own)
_SECTION_MIN_S = {"replay": 40, "train": 25, "cmdbuf": 40, "compile": 15}


def _vname(backend: str, dtype: str) -> str:
    return f"{backend}/{_SHORT[dtype]}"


# --- sections ----------------------------------------------------------------------------------

def section_device(args, out: dict, deadline: Deadline) -> None:
    """GEMM rates, copy bandwidth and the per-iteration cost of a lax.scan."""
    import jax
    import jax.numpy as jnp

    from foxhunt_jax.agent.network import F32_PRECISION

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
        m = n if name == "bf16" else n // 2  # f32 is ~10x slower; keep the call short
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


def section_forward(args, out: dict, deadline: Deadline, market) -> None:
    """Q-forward alone: xla vs pallas (each launch shape), f32 vs bf16, at each of
    ``--forward-n``; equality with the Flax forward on the device, on fresh inputs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from foxhunt_jax.agent.network import make_network, q_forward, support as make_support
    from foxhunt_jax.jitcache import jit
    from pallas_kernels.q_forward import forward_flops, fused_q_forward
    from pallas_kernels.tuning import for_device

    cfg = _variant_cfg(args, "xla", "float32")
    sizes = cfg.env.branch_sizes
    obs_dim = _obs_dim(cfg, market)
    z = make_support(cfg.network.v_min, cfg.network.v_max, cfg.network.atoms)
    flops = forward_flops(obs_dim, cfg.network.trunk, cfg.network.head, cfg.network.atoms, sizes)
    out.update({"n": list(args.forward_n), "obs_dim": obs_dim, "flops_per_row": flops,
                "rows": []})
    reps = 3 if args.quick else 10
    nets = {dt: make_network(dataclasses.replace(cfg.network, dtype=dt), sizes)
            for dt in ("float32", "bfloat16")}
    params = nets["float32"].init(jax.random.key(args.seed), jnp.zeros((1, obs_dim), jnp.float32))
    inputs = {n: jax.random.normal(jax.random.key(args.seed + 1), (n, obs_dim), jnp.float32)
              for n in args.forward_n}

    for dtype in sorted({d for _, d in args.variants}):
        net = nets[dtype]
        # fresh inputs for the equality check (not the timing inputs), of the largest N so that
        # the checked program is the timed one
        obs_chk = jax.random.normal(jax.random.key(args.seed + 2), (max(args.forward_n), obs_dim),
                                    jnp.float32) * 2.0
        # Both backends are timed returning expected Q and actions (one Pallas program per
        # launch shape serves the check and the timing; writing Q is ~64 B a row).
        f_xla = jit(lambda p, o: q_forward(p, o, net, z, with_q=True))
        ref_q, ref_a = f_xla(params, obs_chk)
        ref_q = np.concatenate([np.asarray(x) for x in ref_q], axis=1)
        ref_a = np.asarray(ref_a)
        for n, obs in inputs.items():
            ms = time_calls(lambda: f_xla(params, obs), reps, warmup=2)
            row = {"n": n, "backend": "xla", "dtype": dtype, "config": "flax",
                   **_fwd_rates(ms, n, flops)}
            out["rows"].append(row)
            print(f"  forward N={n} xla/{dtype}: {row['ms']:.3f} ms", flush=True)
        if dtype == "float32" and not args.forward_f32_kernel:
            # the float32 kernel lost (BENCHMARKS.md) and its Triton compile takes minutes
            out.setdefault("skipped", []).append("pallas/float32: --forward-f32-kernel not set")
            continue
        default = for_device().q_forward_config(dtype)
        for kc in [default] + [c for c in args.kernel_configs if c != default]:
            name = kernel_config_name(kc)
            if not deadline.ok(30):
                out.setdefault("skipped", []).append(f"pallas/{dtype} {name}: time budget")
                continue
            chk_row = {"n": int(obs_chk.shape[0]), "backend": "pallas", "dtype": dtype,
                       "config": name, "default": kc == default, "kind": "equality"}
            try:
                f = jit(lambda p, o, _c=kc: fused_q_forward(p, o, net, z, config=_c))
                q, a = f(params, obs_chk)
                q = np.concatenate([np.asarray(x) for x in q], axis=1)
                chk_row.update(_equality(q, np.asarray(a), ref_q, ref_a, sizes))
                del q, a
                for n, obs in inputs.items():
                    ms = time_calls(lambda: f(params, obs), reps, warmup=2)
                    row = {"n": n, "backend": "pallas", "dtype": dtype, "config": name,
                           "default": kc == default, **_fwd_rates(ms, n, flops),
                           "q_rel_err": chk_row["q_rel_err"],
                           "action_mismatch": chk_row["action_mismatch"]}
                    out["rows"].append(row)
                    print(f"  forward N={n} pallas/{dtype} {name}: {row['ms']:.3f} ms, q rel "
                          f"err {row['q_rel_err']:.2e}, action mismatches "
                          f"{row['action_mismatch']}", flush=True)
            except Exception as e:
                chk_row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                print(f"  forward pallas/{dtype} {name}: FAILED {chk_row['error'][:300]}",
                      flush=True)
            out.setdefault("equality", []).append(chk_row)
        if dtype == "bfloat16" and deadline.ok(30):
            _curiosity_rows(out, cfg, obs_chk, inputs, reps, args.seed, args.kernel_configs)
        if dtype == "bfloat16" and deadline.ok(30):
            _logits_rows(out, net, params, obs_chk, inputs, reps, flops)
        if dtype == "bfloat16" and deadline.ok(30):
            _act_rows(out, net, params, z, obs_chk, inputs, reps, flops)
        if dtype == "bfloat16" and deadline.ok(30):
            _loss_rows(out, net, params, z, obs_chk, inputs, reps, flops)


def _logits_rows(out: dict, net, params, obs_chk, inputs: dict, reps: int, flops: int) -> None:
    """The forward of the loss's no-gradient callers (initial priorities, validation loss):
    each branch's logits of given actions (``taken_logits``) on XLA (Flax) against the fused
    kernel (default launch shape), timed at each N, and their largest relative difference on
    the fresh inputs."""
    import jax
    import numpy as np

    from foxhunt_jax.jitcache import jit

    fns = {b: jit(lambda p, o, a, _b=be: _b.taken_logits(p, o, a, net))
           for b, be in _named_backends().items()}

    def actions(n, seed):  # fresh uniform actions per branch
        keys = jax.random.split(jax.random.key(seed), len(net.branch_sizes))
        return jax.numpy.stack([jax.random.randint(k, (n,), 0, nd) for k, nd in
                                zip(keys, net.branch_sizes)], axis=1)
    def flat(xs):
        return np.concatenate([np.asarray(x).reshape(x.shape[0], -1) for x in xs], axis=1)

    _check_and_time(out, fns, params, obs_chk, inputs, actions, (11, 12), reps, flops,
                    net.dtype, "taken_logits", "taken-action logits", flat, "logits_rel_err",
                    "Flax")


def _named_backends() -> dict:
    """Both backends on this device, by name, for the sections that time them side by side."""
    from foxhunt_jax import backend
    from pallas_kernels.tuning import for_device

    return {name: backend.make(name, for_device()) for name in backend.NAMES}


def _act_rows(out: dict, net, params, z, obs_chk, inputs: dict, reps: int, flops: int) -> None:
    """The collection forward (``network.act``: greedy actions, and each branch's logits of the
    action taken under explore draws at epsilon 0.1) on XLA against the fused kernel, timed at
    each N; on the fresh inputs, the greedy actions that differ and the largest relative
    difference of the taken logits where both took the same actions."""
    import jax
    import numpy as np

    from foxhunt_jax.agent.network import explore_draws
    from foxhunt_jax.jitcache import jit

    fns = {b: jit(lambda p, o, r, _b=be: _b.act(p, o, r, net, z))
           for b, be in _named_backends().items()}

    def draws(n, seed):
        return explore_draws(jax.random.key(seed), n, net.branch_sizes, 0.1)
    try:
        r = draws(obs_chk.shape[0], 13)
        (g, a, t), (g_x, a_x, t_x) = [jax.device_get(fns[b](params, obs_chk, r))
                                      for b in ("pallas", "xla")]
        same = np.all(a == a_x, axis=1)
        rel = _rel_err(np.concatenate([x[same] for x in t], axis=1),
                       np.concatenate([x[same] for x in t_x], axis=1))
        out.setdefault("equality", []).append({
            "n": int(obs_chk.shape[0]), "backend": "pallas", "dtype": net.dtype, "kind": "act",
            "greedy_differ_share": float(np.mean(g != g_x)), "taken_logits_rel_err": rel})
        _time_backends(out, fns, params, inputs, lambda n: draws(n, 14), reps, flops, net.dtype,
                       "act", "act (greedy + taken logits)",
                       f", greedy differ {np.mean(g != g_x):.1e}, taken rel err {rel:.2e}")
    except Exception as e:
        out.setdefault("equality", []).append({"kind": "act",
                                               "error": f"{type(e).__name__}: {str(e)[:400]}"})
        print(f"  act: FAILED {str(e)[:300]}", flush=True)


def _loss_rows(out: dict, net, params, z, obs_chk, inputs: dict, reps: int, flops: int) -> None:
    """The target's part of the C51 loss (``loss.bootstrap_loss``: the target forward at the
    bootstrap actions, its softmax, the projection and the cross-entropy with given online
    logits), as the initial priorities and the validation loss run it, on XLA against the
    fused kernel, timed at each N; the largest relative difference on fresh inputs (returns
    spread over the support, a fifth of the rows terminated)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from foxhunt_jax.jitcache import jit

    fns = {b: jit(lambda p, o, a, _b=be: _b.bootstrap_loss(p, o, *a, net, z))
           for b, be in _named_backends().items()}

    def loss_inputs(n, seed):
        nb = len(net.branch_sizes)
        k = jax.random.split(jax.random.key(seed), 2 * nb + 2)
        best = jnp.stack([jax.random.randint(k[d], (n,), 0, nd)
                          for d, nd in enumerate(net.branch_sizes)], axis=1)
        taken = tuple(2.0 * jax.random.normal(k[nb + d], (n, net.atoms)) for d in range(nb))
        returns = 5.0 * jax.random.normal(k[-2], (n,))
        discounts = jnp.where(jax.random.uniform(k[-1], (n,)) < 0.2, 0.0, 0.99)
        return best, taken, returns, discounts
    _check_and_time(out, fns, params, obs_chk, inputs, loss_inputs, (15, 16), reps, flops,
                    net.dtype, "bootstrap_loss", "target forward + C51 loss",
                    lambda x: np.asarray(x, np.float64), "loss_rel_err", "XLA")


def _curiosity_rows(out: dict, cfg, obs_chk, inputs: dict, reps: int, seed: int,
                    kernel_configs=()) -> None:
    """The curiosity pass of a bfloat16 run (``curiosity.prediction_error`` at precision
    ``bf16x3``) on XLA against the RND kernel, timed at each N (its own FLOPs a row: both
    networks, one product each); the largest relative difference on the fresh inputs. Each
    ``--kernel-configs`` entry's rows, warps and minimum rows are timed as a launch shape of
    the RND kernel too (``config`` ``rnd:rows:warps:min_rows``)."""
    import dataclasses as dc

    import jax
    import numpy as np

    from foxhunt_jax.agent import curiosity
    from foxhunt_jax.jitcache import jit
    from pallas_kernels import rnd as rnd_kernel
    from pallas_kernels.tuning import KernelConfig, for_device

    c = dc.replace(cfg.curiosity, precision="bf16x3")
    d = int(obs_chk.shape[1])
    rnd = curiosity.init(jax.random.key(seed + 3), d, c)
    flops = 2 * 2 * (d * c.hidden + c.hidden * c.hidden + c.hidden * c.embed)
    fns = {b: jit(lambda r, o, _, _b=be: _b.novelty(r, o))
           for b, be in _named_backends().items()}
    to_f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    _check_and_time(out, fns, rnd, obs_chk, inputs, lambda n, s: None, (17, 18), reps, flops,
                    "bfloat16", "curiosity", "curiosity pass (bf16 x3)", to_f64,
                    "novelty_rel_err", "XLA")
    shapes = {KernelConfig(block_rows=kc.block_rows, num_warps=kc.num_warps,
                           min_rows=kc.min_rows, min_warps=min(kc.num_warps, 4))
              for kc in kernel_configs} - {for_device().rnd}
    for kc in sorted(shapes, key=lambda k: (k.block_rows, k.num_warps, k.min_rows)):
        name = f"rnd:{kc.block_rows}:{kc.num_warps}:{kc.min_rows}"
        shaped = jit(lambda r, o, _, _kc=kc: rnd_kernel.prediction_error(
            r.target_params, r.predictor_params, o, config=_kc))
        _check_and_time(out, {"pallas": shaped, "xla": fns["xla"]}, rnd, obs_chk, inputs,
                        lambda n, s: None, (17, 18), reps, flops, "bfloat16", name,
                        f"curiosity pass {name}", to_f64, "novelty_rel_err", "XLA",
                        timed=("pallas",))


def _check_and_time(out: dict, fns: dict, params, obs_chk, inputs: dict, extra, seeds: tuple,
                    reps: int, flops: int, dtype: str, kind: str, label: str, to_array,
                    err_key: str, reference: str, timed: tuple = ("xla", "pallas")) -> None:
    """Both backends of ``fns`` (``fn(params, obs, extra(n, seed))``) on the fresh check
    inputs (``seeds[0]``): their largest relative difference (``to_array`` of each result)
    into ``out["equality"]`` under ``err_key``; then those of ``timed`` timed at each N of
    ``inputs`` (:func:`_time_backends`, ``seeds[1]``). A failure is recorded, not raised."""
    import jax

    try:
        arg = extra(obs_chk.shape[0], seeds[0])
        got, ref = (to_array(jax.device_get(fns[b](params, obs_chk, arg)))
                    for b in ("pallas", "xla"))
        rel = _rel_err(got, ref)
        out.setdefault("equality", []).append({"n": int(obs_chk.shape[0]), "backend": "pallas",
                                               "dtype": dtype, "kind": kind, err_key: rel})
        _time_backends(out, {b: fns[b] for b in timed}, params, inputs,
                       lambda n: extra(n, seeds[1]), reps, flops, dtype, kind, label,
                       f", rel err vs {reference} {rel:.2e}")
    except Exception as e:
        out.setdefault("equality", []).append({"kind": kind,
                                               "error": f"{type(e).__name__}: {str(e)[:400]}"})
        print(f"  {label}: FAILED {str(e)[:300]}", flush=True)


def _time_backends(out: dict, fns: dict, params, inputs: dict, extra, reps: int, flops: int,
                   dtype: str, config: str, label: str, pallas_note: str) -> None:
    """Times each backend's ``fn(params, obs, extra(n))`` at each N of ``inputs`` into
    ``out["rows"]`` (``config`` names the forward) and prints it."""
    for n, obs in inputs.items():
        arg = extra(n)
        for backend, f in fns.items():
            ms = time_calls(lambda: f(params, obs, arg), reps, warmup=2)
            out["rows"].append({"n": n, "backend": backend, "dtype": dtype, "config": config,
                                **_fwd_rates(ms, n, flops)})
            print(f"  {label} N={n} {backend}/{dtype}: {statistics.median(ms):.3f} ms"
                  + (pallas_note if backend == "pallas" else ""), flush=True)


def _fwd_rates(ms: list[float], n: int, flops: int) -> dict:
    med = statistics.median(ms)
    return {"ms": med, "ms_spread": spread(ms), "rows_per_s": n / (med * 1e-3),
            "tflops": n * flops / (med * 1e-3) / 1e12}


def _rel_err(got, ref) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    import numpy as np

    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def _equality(q, a, ref_q, ref_a, sizes) -> dict:
    """Kernel vs Flax: max relative expected-Q error; action mismatches outside near-ties."""
    import numpy as np

    rel = _rel_err(q, ref_q)
    tol = 1e-4 * max(float(np.max(np.abs(ref_q))), 1e-30)  # a tie: top two within tol
    mismatch, ties, off = 0, 0, 0
    for d, n_d in enumerate(sizes):
        block = ref_q[:, off:off + n_d]
        off += n_d
        top2 = np.sort(block, axis=1)[:, -2:] if n_d > 1 else np.concatenate(
            [block - np.inf, block], axis=1)
        near_tie = (top2[:, 1] - top2[:, 0]) <= max(tol, 4 * rel * np.max(np.abs(ref_q)))
        differ = a[:, d] != ref_a[:, d]
        mismatch += int(np.sum(differ & ~near_tie))
        ties += int(np.sum(differ & near_tie))
    return {"q_rel_err": rel, "action_mismatch": mismatch, "action_differ_at_ties": ties,
            "checked_rows": int(q.shape[0])}


def _obs_dim(cfg, market) -> int:
    from foxhunt_jax.data.features import build_tables
    from foxhunt_jax.env.trading import PORTFOLIO_DIM

    tables = build_tables(market, cfg.data.splits, cfg.env.episode_length,
                          cfg.data.split_dates)
    return int(tables.features.shape[1]) + PORTFOLIO_DIM


def _time_epochs(tr, state, count: int, warmup: int) -> tuple[dict, dict, dict]:
    """Runs warmup + count epochs from ``state``: (per-phase lists of the last ``count``, the
    first epoch's ``phase_ms``, the last record).

    Each epoch queues the next one's Experience and Training (``run_epoch(queue_next=True)``,
    as training without a checkpoint between epochs does), so the times are those of a steady
    loop: Experience runs from the previous epoch's Validation to its own completion.
    """
    phases = {"experience": [], "training": [], "validation": [], "total": []}
    first = rec = None
    for e in range(warmup + count):
        state, rec = tr.run_epoch(state, queue_next=e + 1 < warmup + count)
        ms = rec["phase_ms"]
        first = first or ms
        if e >= warmup:
            for k in ("experience", "training", "validation"):
                phases[k].append(ms[k])
            phases["total"].append(ms["experience"] + ms["training"] + ms["validation"])
    return phases, first, rec


def _run_epochs(tr, epochs: int, warmup: int) -> dict:
    """Runs warmup + epochs epochs; returns per-phase spreads and the first epoch's init/compile
    (:func:`_time_epochs`)."""
    phases, first, rec = _time_epochs(tr, tr.init_state(), epochs, warmup)
    return {"init_ms": first.get("init", 0.0), "compile_ms": first.get("compile", 0.0),
            "phases": {k: spread(v) for k, v in phases.items()},
            "samples": phases, "finite": bool(rec["finite_params"]), "last_loss": rec["loss"]}


def section_seed(args, out: dict, deadline: Deadline, market) -> None:
    """The seed workload's epoch, per phase, for every variant (in this process)."""
    out.update({"config": str(args.config), "epochs": args.epochs, "warmup": args.warmup,
                "rows": []})
    for backend, dtype in args.variants:
        if not deadline.ok(20):
            out.setdefault("skipped", []).append(f"{backend}/{dtype}: time budget")
            continue
        row = {"backend": backend, "dtype": dtype}
        try:
            cfg = _variant_cfg(args, backend, dtype)
            row.update({"num_episodes": cfg.train.num_episodes,
                        "episode_length": cfg.env.episode_length,
                        "train_steps": cfg.train.train_steps, "batch_size": cfg.train.batch_size,
                        "validation_windows": cfg.train.validation_windows})
            tr = _build_trainer(cfg, market)
            row.update(_run_epochs(tr, args.epochs, args.warmup))
            k = max(cfg.train.train_steps, 1)
            row["train_step_ms"] = row["phases"]["training"]["median"] / k
            ph = row["phases"]
            print(f"  seed {backend}/{dtype}: total {ph['total']['median']:.2f} ms (exp "
                  f"{ph['experience']['median']:.2f}, train {ph['training']['median']:.2f}, val "
                  f"{ph['validation']['median']:.2f}), compile {row['compile_ms'] / 1e3:.1f} s",
                  flush=True)
            del tr
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        out["rows"].append(row)


def _child_cmd(args, variants, json_path: Path, epochs: int) -> list[str]:
    cmd = [sys.executable, "-m", "foxhunt_jax.bench", "--child", "--config", str(args.config),
           "--variants", ",".join(f"{b}:{d}" for b, d in variants), "--json", str(json_path),
           "--epochs", str(epochs), "--warmup", "1"]
    for o in args.overrides:
        cmd += ["--set", o]
    return cmd


def _run_child(cmd, env, timeout: float) -> dict:
    t0 = time.perf_counter()
    json_path = Path(cmd[cmd.index("--json") + 1])
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not json_path.exists():
        return {"error": f"exit {proc.returncode}: {(proc.stderr or '')[-600:]}"}
    res = json.loads(json_path.read_text())
    res["process_wall_s"] = wall
    return res


def _child_env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    # the parent holds device memory: a child must not try to take most of it up front
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.update(extra)
    return env


def _report_child(name: str, res: dict) -> None:
    for row in res.get("rows", []):
        extra = ""
        if "phases" in row:
            extra = f", epoch {row['phases']['total']['median']:.2f} ms"
        print(f"  {name} {row['backend']}/{row['dtype']}: compile "
              f"{row.get('compile_ms', float('nan')) / 1e3:.2f} s (init "
              f"{row.get('init_ms', float('nan')) / 1e3:.2f} s){extra}", flush=True)
    if "error" in res:
        print(f"  {name}: FAILED {res['error'][-300:]}", flush=True)


def section_compile(args, out: dict, deadline: Deadline) -> None:
    """Whole-epoch compile, per variant in fresh processes: cold (a cache folder of its own,
    empty, so no variant reuses another's programs or autotuning results), then from the caches
    that cold process filled: JAX's persistent cache alone, and with the executable cache
    (:mod:`foxhunt_jax.jitcache`)."""
    variants = args.compile_variants or args.variants
    steps = (("cold", {}), ("cached_xla_only", {"FOXHUNT_JAX_EXECUTABLE_CACHE": "off"}),
             ("cached", {}))
    for name, _ in steps:
        out[name] = {"rows": []}
    out["cold"]["source"] = "a fresh process per variant with an empty cache folder"
    for variant in variants:
        label = "{}/{}".format(*variant)
        with tempfile.TemporaryDirectory(prefix="foxhunt-bench-compile-") as cache:
            # a step that is not run, or fails, skips the later ones: each reads the cache the
            # ones before it fill
            for k, (name, extra) in enumerate(steps):
                if not deadline.ok(20):
                    skipped = steps[k:]
                    break
                res = _run_child(_child_cmd(args, [variant], Path(cache) / f"{name}.json", 0),
                                 _child_env(FOXHUNT_JAX_CACHE=cache, **extra),
                                 deadline.left() - 10)
                _report_child(name, res)
                if "error" in res:
                    out[name]["error"] = f"{label}: {res['error']}"
                    skipped = steps[k + 1:]
                    break
                out[name]["rows"] += res.get("rows", [])
            else:
                skipped = ()
            for later, _ in skipped:
                out[later].setdefault("skipped", []).append(label)


def section_cmdbuf(args, out: dict, deadline: Deadline) -> None:
    """The seed epoch with XLA's default command buffers (no while loops), in a fresh process."""
    import jax

    if jax.default_backend() != "gpu" and not args.quick:
        out["skipped"] = "command buffers are a GPU feature"
        return
    flags = (os.environ.get("XLA_FLAGS", "") + " " + CMDBUF_FLAGS).strip()
    with tempfile.TemporaryDirectory(prefix="foxhunt-bench-cmdbuf-") as tmp:
        epochs = max(3, args.epochs // 2)
        res = _run_child(_child_cmd(args, args.cmdbuf_variants, Path(tmp) / "out.json", epochs),
                         _child_env(FOXHUNT_JAX_CACHE="off", XLA_FLAGS=flags),
                         deadline.left() - 5)
    res["xla_flags"] = flags
    res["epochs"] = epochs
    out.update(res)
    _report_child("XLA default command buffers", res)


def child_main(args) -> dict:
    """A fresh process: build, init and compile each variant (+ ``--epochs`` epochs)."""
    from foxhunt_jax.jitcache import enable_compilation_cache
    from foxhunt_jax.data.loader import load_market

    t_import = time.perf_counter()
    import jax
    cache = enable_compilation_cache()
    jax.devices()
    startup = time.perf_counter() - t_import
    rows = []
    market = None
    for backend, dtype in args.variants:
        cfg = _variant_cfg(args, backend, dtype)
        if market is None:
            market = load_market(cfg.data.source, sort=cfg.data.sort, synthetic=cfg.data.synthetic)
        tr = _build_trainer(cfg, market)
        state = tr.init_state()
        init_ms = tr.init_ms
        tr.compile(state, queued=True)  # the programs of queued epochs, as the seed section's
        row = {"backend": backend, "dtype": dtype, "init_ms": init_ms,
               "compile_ms": tr.compile_ms, "executables_loaded": tr.executables_loaded,
               "programs": len(tr.pipeline.programs)}
        if args.epochs > 0:
            tr.init_ms = tr.compile_ms = 0.0
            phases, _, _ = _time_epochs(tr, state, args.epochs, args.warmup)
            row["phases"] = {k: spread(v) for k, v in phases.items()}
        rows.append(row)
    res = {"cache": cache, "jax_startup_s": startup, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


def make_rollout(learner, backend, adapter, env_params, num_steps: int, *, use_q: bool = True,
                 use_rnd: bool = True):
    """The collection loop alone: ``run(agent, rollout, key, epsilon) -> (rollout, traj)``.

    :func:`foxhunt_jax.training.collect.trajectory` (Q-forward with the learner's backend,
    per-branch epsilon-greedy, env step, auto-reset, the per-step transitions written out; one
    fused kernel with ``backend=pallas``) followed by the curiosity pass over the next
    observations as the collector runs it (:func:`~foxhunt_jax.training.collect.
    trajectory_novelty`: per kernel launch, so the first launch's pass can run beside the
    second). Not included: n-step targets,
    initial priorities and the replay write. ``use_rnd=False`` skips curiosity; ``use_q=False``
    times the env's own random-action rollout (:func:`foxhunt_jax.env.trading.rollout`: env
    step, random actions, auto-reset; no forward, no transitions kept).
    """
    from foxhunt_jax.env import trading
    from foxhunt_jax.training import collect

    def run(agent, rollout, key, epsilon):
        if not use_q:
            return trading.rollout(key, env_params, trading.random_policy(
                learner.network.branch_sizes), rollout.obs.shape[0], num_steps)
        rollout, traj = collect.trajectory(learner, backend, adapter, env_params, agent.params,
                                           rollout, key, epsilon, num_steps)
        if use_rnd and agent.rnd is not None:
            traj = dict(traj, novelty=collect.trajectory_novelty(backend, adapter, env_params,
                                                                 agent.rnd, traj["next_obs"]))
        return rollout, traj

    return run


def section_collect(args, out: dict, deadline: Deadline, market, seed_rows: list) -> None:
    """Collection throughput at each N (every variant at the largest N, ``--collect-variants``
    below it), the experience phase at ``--experience-n`` and, from the seed section, at its N;
    a breakdown at the largest N."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from foxhunt_jax.agent import replay
    from foxhunt_jax.agent.learner import init_agent, make_learner
    from foxhunt_jax.backend import resolve
    from foxhunt_jax.jitcache import jit
    from foxhunt_jax.training import collect as collect_mod
    from foxhunt_jax.env.trading import PORTFOLIO_DIM
    from foxhunt_jax.training.trainer import TRADING_ADAPTER

    out.update({"rows": [], "breakdown": []})
    for r in seed_rows:  # the seed epoch's experience phase: collect + replay add at its N
        if "phases" in r:
            ms = r["phases"]["experience"]["median"]
            out["rows"].append({"n": r["num_episodes"], "backend": r["backend"],
                                "dtype": r["dtype"], "kind": "experience (seed epoch)",
                                "ms": ms, "env_steps_per_s":
                                    r["num_episodes"] * r["episode_length"] / (ms * 1e-3)})
    eps = 0.1  # a late-training epsilon: mostly greedy actions, as after the decay
    largest = max(args.collect_n)
    bd_variant = (("pallas", "bfloat16") if ("pallas", "bfloat16") in args.variants
                  else args.variants[-1])
    for n in args.collect_n:
        cfg0 = _variant_cfg(args, "xla", "float32", [f"train.num_episodes={n}"])
        length = cfg0.env.episode_length
        out["episode_length"] = length
        tr = _build_trainer(cfg0, market)
        env_p = tr.env_params["train"]
        start = jit(lambda p, k, _n=n: collect_mod.start(TRADING_ADAPTER, p, k, _n))
        rollout0 = start(env_p, jax.random.key(args.seed))
        reps = 3 if n >= 262144 else 5
        variants = args.variants if n == largest else (args.collect_variants or args.variants)
        for backend, dtype in variants:
            if not deadline.ok(25):
                out.setdefault("skipped", []).append(f"N={n} {backend}/{dtype}: time budget")
                continue
            cfg = _variant_cfg(args, backend, dtype, [f"train.num_episodes={n}"])
            resolved = resolve(cfg.network)
            learner = make_learner(cfg, cfg.env.branch_sizes,
                                   replay_search=resolved.tuning.replay)
            agent = jit(lambda k, _l=learner: init_agent(k, _l, tr.obs_dim))(
                jax.random.key(args.seed))
            kinds = [("rollout", dict(use_q=True, use_rnd=True))]
            if args.breakdown and n == largest and (backend, dtype) == bd_variant:
                kinds += [("rollout_no_curiosity", dict(use_q=True, use_rnd=False)),
                          ("env_only_random_actions", dict(use_q=False, use_rnd=False))]
            for kind, flags in kinds:
                row = {"n": n, "backend": backend, "dtype": dtype, "kind": kind}
                try:
                    run = jit(make_rollout(learner, resolved, TRADING_ADAPTER, env_p, length,
                                           **flags))
                    keys, eps_d = _call_inputs(jax.random.key(args.seed + 7), reps + 2, eps)
                    ms = time_calls(lambda: run(agent, rollout0, next(keys), eps_d), reps,
                                    warmup=1)
                    med = statistics.median(ms)
                    row.update({"ms": med, "ms_spread": spread(ms),
                                "env_steps_per_s": n * length / (med * 1e-3),
                                "us_per_step": med * 1e3 / length})
                    print(f"  collect N={n} {backend}/{dtype} {kind}: {med:.2f} ms, "
                          f"{row['env_steps_per_s'] / 1e9:.3f}e9 env-steps/s", flush=True)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    print(f"  collect N={n} {backend}/{dtype} {kind}: FAILED {row['error'][:200]}",
                          flush=True)
                (out["breakdown"] if kind != "rollout" else out["rows"]).append(row)
            # the whole experience phase: collect (incl. n-step targets and initial priorities)
            # + replay add; its priority pass holds [N*L, width] activations, so only small N
            if n in args.experience_n and deadline.ok(25):
                row = {"n": n, "backend": backend, "dtype": dtype, "kind": "experience"}
                try:
                    cap = 1 << max(int(math.ceil(math.log2(n * length))), 10)
                    example = {"obs": {"bar": jnp.zeros((), jnp.int32),
                                       "portfolio": jnp.zeros((PORTFOLIO_DIM,), jnp.float32)},
                               "action": jnp.zeros((len(cfg.env.branch_sizes),), jnp.int32),
                               "reward": jnp.zeros((), jnp.float32),
                               "discount": jnp.zeros((), jnp.float32)}
                    example["next_obs"] = example["obs"]
                    buf = replay.init(example, cap)

                    def phase(agent, rollout, buf, key, e, _l=learner, _b=resolved):
                        r2, items, prio, rnd, stats = collect_mod.collect(
                            _l, _b, TRADING_ADAPTER, env_p, agent, rollout, key, e, length)
                        return r2, replay.add(buf, items, prio, cfg.replay.alpha,
                                              cfg.replay.priority_eps), stats

                    ph = jit(phase)
                    keys, eps_d = _call_inputs(jax.random.key(args.seed + 9), reps + 2, eps)
                    ms = time_calls(lambda: ph(agent, rollout0, buf, next(keys), eps_d), reps,
                                    warmup=1)
                    med = statistics.median(ms)
                    row.update({"ms": med, "ms_spread": spread(ms),
                                "env_steps_per_s": n * length / (med * 1e-3)})
                    print(f"  experience N={n} {backend}/{dtype}: {med:.2f} ms", flush=True)
                    del buf
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    print(f"  experience N={n} {backend}/{dtype}: FAILED {row['error'][:200]}",
                          flush=True)
                out["rows"].append(row)
            del agent
        del rollout0, tr
        np.asarray(0)
    if ("pallas", "bfloat16") in args.variants and deadline.ok(30):
        try:
            out["equality"] = rollout_equality(args, market, min(args.collect_n))
        except Exception as e:
            out["equality"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            traceback.print_exc()


def _call_inputs(key, calls: int, eps: float):
    """An iterator over ``calls`` device keys and epsilon as a device scalar, made before the
    timing starts: slicing a key array or copying a host scalar inside a timed call would add
    an eager device op (a launch and a copy) to every sample."""
    import jax
    import jax.numpy as jnp

    keys = list(jax.random.split(key, calls))
    return iter(jax.block_until_ready(keys)), jax.block_until_ready(jnp.float32(eps))


def rollout_equality(args, market, n: int) -> dict:
    """The fused rollout kernel against the scan, bfloat16 network, same keys and parameters.

    Near-ties of expected Q can pick different greedy actions in the two (their bf16 GEMMs sum in
    different orders), after which an episode's paths part; so this reports the share of
    episodes whose L actions all agree and, over those, the largest reward and portfolio
    differences.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from foxhunt_jax.agent.learner import init_agent, make_learner
    from foxhunt_jax.backend import resolve
    from foxhunt_jax.jitcache import jit
    from foxhunt_jax.training import collect
    from foxhunt_jax.training.trainer import TRADING_ADAPTER

    cfg = _variant_cfg(args, "xla", "bfloat16", [f"train.num_episodes={n}"])
    tr = _build_trainer(cfg, market)
    env_p, length = tr.env_params["train"], cfg.env.episode_length
    rollout = jit(lambda p, k: collect.start(TRADING_ADAPTER, p, k, n))(
        env_p, jax.random.key(args.seed))
    agent = None
    trajs = {}
    for backend in ("xla", "pallas"):
        c = _variant_cfg(args, backend, "bfloat16", [f"train.num_episodes={n}"])
        learner = make_learner(c, c.env.branch_sizes)
        if agent is None:
            agent = jit(lambda k, _l=learner: init_agent(k, _l, tr.obs_dim))(
                jax.random.key(args.seed))
        run = jit(lambda a, r, k, _l=learner, _b=resolve(c.network): collect.trajectory(
            _l, _b, TRADING_ADAPTER, env_p, a.params, r, k, jnp.float32(0.1), length)[1])
        trajs[backend] = jax.device_get(run(agent, rollout, jax.random.key(args.seed + 1)))
    ref, got = trajs["xla"], trajs["pallas"]
    same = np.all(ref["action"] == got["action"], axis=(0, 2))  # [N]
    res = {"n": n, "episode_length": length, "episodes_all_actions_equal": float(same.mean()),
           "action_mismatch_share": float(np.mean(ref["action"] != got["action"]))}
    if same.any():
        res["max_abs_reward_diff"] = float(np.max(np.abs(ref["reward"] - got["reward"])[:, same]))
        res["max_abs_portfolio_diff"] = float(np.max(np.abs(
            ref["next_obs"]["portfolio"] - got["next_obs"]["portfolio"])[:, same]))
        res["bars_equal"] = bool(np.all(ref["next_obs"]["bar"][:, same]
                                        == got["next_obs"]["bar"][:, same]))
        res["greedy_equal"] = bool(np.all(ref["greedy"][:, same] == got["greedy"][:, same]))
        res["taken_logits_rel_err"] = _rel_err(
            np.stack([x[:, same] for x in got["taken_logits"]]),
            np.stack([x[:, same] for x in ref["taken_logits"]]))
    print(f"  rollout kernel vs scan at N={n}: {res}", flush=True)
    return res


def seed_train_rows(seed_rows: list) -> list[dict]:
    """The learner's steps/s at the seed batch, from the seed section's XLA rows (the
    Q-forward backend does not enter training)."""
    rows = []
    for row in seed_rows:
        if "phases" in row and row["backend"] == "xla":
            step = row["train_step_ms"]
            rows.append({"dtype": row["dtype"], "batch": row["batch_size"], "step_ms": step,
                         "steps_per_s": 1e3 / step,
                         "samples_per_s": row["batch_size"] * 1e3 / step,
                         "source": "seed section"})
    return rows


def section_train(args, out: dict, deadline: Deadline, market, seed_rows: list) -> None:
    """Learner throughput: steps/s at the seed batch (from the seed section), samples/s at a big
    batch (its own trainer; the Q-forward backend does not enter training)."""
    out["rows"] = seed_train_rows(seed_rows)
    for dtype in sorted({d for _, d in args.variants}):
        if not deadline.ok(25):
            out.setdefault("skipped", []).append(f"batch {args.big_batch} {dtype}: time budget")
            continue
        row = {"dtype": dtype, "batch": args.big_batch}
        try:
            cfg = _variant_cfg(args, "xla", dtype, [f"train.batch_size={args.big_batch}"])
            tr = _build_trainer(cfg, market)
            res = _run_epochs(tr, max(3, args.epochs // 4), 1)
            k = max(cfg.train.train_steps, 1)
            step = res["phases"]["training"]["median"] / k
            row.update({"step_ms": step, "steps_per_s": 1e3 / step,
                        "samples_per_s": args.big_batch * 1e3 / step,
                        "training_ms": res["phases"]["training"], "train_steps": k})
            print(f"  train batch {args.big_batch} {dtype}: {step:.3f} ms/step, "
                  f"{row['samples_per_s'] / 1e6:.2f}M samples/s", flush=True)
            del tr
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        out["rows"].append(row)


def section_replay(args, out: dict, deadline: Deadline) -> None:
    """Replay add/sample/update beside flashbax, through scripts/bench_replay.py."""
    path = REPO / "scripts" / "bench_replay.py"
    if not path.exists():
        out["error"] = f"{path} not found (run from a checkout)"
        return
    spec = importlib.util.spec_from_file_location("foxhunt_bench_replay", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if args.quick:
        argv = ["--capacities", "2^10", "--add-sizes", "256,64", "--batch-sizes", "16",
                "--repeats", "2", "--warmup", "1"]
    else:
        argv = ["--capacities", args.replay_capacities, "--repeats", str(args.replay_repeats)]
    out.update(mod.main(argv))


# --- roofline ------------------------------------------------------------------------------------

def roofline(res: dict, args) -> dict:
    """FLOPs and bytes per env step against the measured GEMM rate and bandwidth."""
    from foxhunt_jax.config import load_config

    cfg = load_config(args.config, list(args.overrides))
    fwd = res.get("forward", {})
    dev = res.get("device", {})
    obs_dim = fwd.get("obs_dim")
    if not obs_dim or "gemm" not in dev:
        return {}
    q_flops = fwd["flops_per_row"]
    h, e = cfg.curiosity.hidden, cfg.curiosity.embed
    # RND: target and predictor, each D -> h -> h -> e
    rnd_flops = 0 if cfg.curiosity.coef == 0 else 2 * 2 * (obs_dim * h + h * h + h * e)
    # The fewest bytes an env step moves: the feature row gathered (F floats), open/high/low/
    # close/sigma at t and t+1, the episode state read and written (10 x 4 B each way), the
    # transition written (bar + 6 portfolio floats for s and s', 3 actions, reward, extrinsic,
    # bonus, novelty, 2 flags), what the priorities reuse of the step's forward (the greedy
    # actions and each branch's logits of the action taken) and the observation written and
    # read back by the next forward.
    f = obs_dim - 6
    nb = len(cfg.env.branch_sizes)
    reuse = 4 * nb + 4 * nb * cfg.network.atoms
    bytes_step = (4 * f + 2 * 5 * 4 + 2 * 10 * 4 + (2 * 28 + 12 + 16 + 2) + reuse
                  + 2 * obs_dim * 4)
    bf16 = dev["gemm"]["bf16"]["tflops"] * 1e12
    f32 = dev["gemm"]["f32_bf16x6"]["tflops"] * 1e12  # network.F32_PRECISION
    bw = dev["copy"]["gb_per_s"] * 1e9
    out = {"q_forward_flops": q_flops, "rnd_flops": rnd_flops, "bytes_per_step": bytes_step,
           "gemm_bf16_tflops": bf16 / 1e12, "gemm_f32_tflops": f32 / 1e12,
           "copy_gb_per_s": bw / 1e9}
    for name, rate in (("bf16", bf16), ("f32", f32)):
        # curiosity.precision "auto": three bf16 products per GEMM in a bf16 run, f32-accurate
        # (bf16 x6) in a float32 one (curiosity.py says why)
        t = q_flops / rate + rnd_flops / (bf16 / 3 if name == "bf16" else f32)
        out[f"floor_steps_per_s_{name}"] = 1.0 / max(t, bytes_step / bw)
        out[f"floor_steps_per_s_{name}_no_curiosity"] = 1.0 / max(q_flops / rate, bytes_step / bw)
    return out


# --- tables ------------------------------------------------------------------------------------

def _f(x, fmt="{:.2f}"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def tables(res: dict) -> str:
    """The results as markdown tables (what BENCHMARKS.md shows)."""
    lines = []
    meta = res.get("meta", {})
    lines.append(f"device: {meta.get('device')}  jax {meta.get('jax')}  commit {meta.get('commit')}")
    dev = res.get("device", {})
    if "gemm" in dev:
        g = dev["gemm"]
        lines.append(f"GEMM TFLOP/s: bf16 {g['bf16']['tflops']:.1f}, f32 as bf16x6 "
                     f"{g['f32_bf16x6']['tflops']:.1f}, f32 HIGHEST "
                     f"{g['f32_highest']['tflops']:.1f}, f32 default "
                     f"{g['f32_default']['tflops']:.1f}"
                     f"; copy {dev['copy']['gb_per_s']:.0f} GB/s (read+write)")
        sc = dev.get("scan", {})
        lines.append("lax.scan iteration: " + ", ".join(
            f"{k} {v['us_per_iteration']:.1f} us" if "us_per_iteration" in v else f"{k} error"
            for k, v in sc.items() if isinstance(v, dict)))
    seed = res.get("seed", {})
    if seed.get("rows"):
        lines += ["", f"Seed epoch ({seed['config']}, median [p25-p75] of {seed['epochs']} epochs "
                      f"after {seed['warmup']} warm-up), ms",
                  "| variant | experience | training (ms/step) | validation | total | compile s |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in seed["rows"]:
            if "phases" not in r:
                lines.append(f"| {_vname(r['backend'], r['dtype'])} | error: "
                             f"{r.get('error', '')[:80]} |||||")
                continue
            p = r["phases"]
            cell = lambda k: f"{p[k]['median']:.2f} [{p[k]['p25']:.2f}-{p[k]['p75']:.2f}]"
            lines.append(f"| {_vname(r['backend'], r['dtype'])} | {cell('experience')} | "
                         f"{cell('training')} ({r['train_step_ms']:.3f}) | {cell('validation')} | "
                         f"{cell('total')} | {r['compile_ms'] / 1e3:.2f} |")
    comp = res.get("compile", {})
    if comp.get("cold", {}).get("rows"):
        lines += ["", "Whole-epoch compile (the phase programs; a fourth pairs Validation and the"
                      " next Experience where both rollouts are kernels) and the state-init"
                      " program, s: cold = a fresh process per variant with empty caches; then"
                      " fresh processes"
                      " with the caches it filled: JAX's persistent cache"
                      " only (XLA cache) and with the executable cache too (loaded: programs"
                      " it served)",
                  "| variant | cold compile | cold init | XLA cache compile | executable cache"
                  " compile (loaded) | its init |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        rows = {name: {(r["backend"], r["dtype"]): r for r in comp.get(name, {}).get("rows", [])}
                for name in ("cached_xla_only", "cached")}
        for c in comp["cold"]["rows"]:
            v = (c["backend"], c["dtype"])
            x, w = rows["cached_xla_only"].get(v, {}), rows["cached"].get(v, {})
            lines.append(f"| {_vname(*v)} | {c['compile_ms'] / 1e3:.2f} | "
                         f"{c['init_ms'] / 1e3:.2f} | "
                         f"{_f(x.get('compile_ms', float('nan')) / 1e3)} | "
                         f"{_f(w.get('compile_ms', float('nan')) / 1e3)} "
                         f"({w.get('executables_loaded', '-')}/{w.get('programs', '-')}) | "
                         f"{_f(w.get('init_ms', float('nan')) / 1e3)} |")
    for name in ("cold", "cached_xla_only", "cached"):
        if "error" in comp.get(name, {}):
            lines.append(f"compile {name}: error {comp[name]['error'][-200:]}")
    cb = res.get("cmdbuf", {})
    if cb.get("rows") or "error" in cb:
        lines += ["", f"Seed epoch without while loops in command buffers ({cb.get('xla_flags')}),"
                      f" fresh process, median of {cb.get('epochs')} epochs, ms"]
        for r in cb.get("rows", []):
            if "phases" in r:
                p = r["phases"]
                lines.append(f"{_vname(r['backend'], r['dtype'])}: total {p['total']['median']:.2f}"
                             f" (experience {p['experience']['median']:.2f}, training "
                             f"{p['training']['median']:.2f}, validation "
                             f"{p['validation']['median']:.2f}); compile "
                             f"{r['compile_ms'] / 1e3:.2f} s")
        if "error" in cb:
            lines.append(f"error: {cb['error'][-300:]}")
    fwd = res.get("forward", {})
    if fwd.get("rows"):
        lines += ["", f"Q-forward alone ({fwd['flops_per_row']:,} FLOP/row; Pallas launch = "
                      "layout:rows:warps:min_rows)",
                  "| N | variant | launch | ms | rows/s | TFLOP/s | q rel err vs Flax | "
                  "action mismatches |",
                  "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in sorted(fwd["rows"], key=lambda r: (r["n"], r["dtype"], r["backend"])):
            lines.append(f"| {r['n']:,} | {_vname(r['backend'], r['dtype'])} | {r['config']} | "
                         f"{r['ms']:.3f} | {r['rows_per_s'] / 1e9:.3f}e9 | {r['tflops']:.1f} | "
                         f"{_f(r.get('q_rel_err'), '{:.1e}')} | {r.get('action_mismatch', '-')} |")
    for r in fwd.get("equality", []):
        if "error" in r:
            lines.append(f"pallas/{_SHORT.get(r.get('dtype'), '?')} "
                         f"{r.get('config', r.get('kind'))}: error {r['error'][:200]}")
    col = res.get("collect", {})
    if col.get("rows"):
        lines += ["", f"Collection, env-steps/s (L = {col.get('episode_length')}; rollout = the "
                      "collection loop, experience = collect + replay add)",
                  "| N | kind | " + " | ".join(_vname(b, d) for b, d in res["meta"]["variants"]) + " |",
                  "| ---: | --- | " + " | ".join("---:" for _ in res["meta"]["variants"]) + " |"]
        keys = sorted({(r["n"], r["kind"]) for r in col["rows"]})
        for n, kind in keys:
            cells = []
            for b, d in res["meta"]["variants"]:
                r = next((x for x in col["rows"] if x["n"] == n and x["kind"] == kind
                          and x["backend"] == b and x["dtype"] == d), None)
                cells.append("-" if r is None else ("error" if "error" in r else
                                                    f"{r['env_steps_per_s'] / 1e9:.3f}e9"))
            lines.append(f"| {n:,} | {kind} | " + " | ".join(cells) + " |")
        for r in col.get("breakdown", []):
            if "ms" in r:
                lines.append(f"breakdown N={r['n']:,} {_vname(r['backend'], r['dtype'])} "
                             f"{r['kind']}: {r['ms']:.2f} ms ({r['us_per_step']:.1f} us/step), "
                             f"{r['env_steps_per_s'] / 1e9:.3f}e9 env-steps/s")
    trn = res.get("train", {})
    if trn.get("rows"):
        lines += ["", "Training throughput",
                  "| precision | batch | ms/step | steps/s | samples/s |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for r in trn["rows"]:
            if "step_ms" in r:
                lines.append(f"| {r['dtype']} | {r['batch']} | {r['step_ms']:.3f} | "
                             f"{r['steps_per_s']:.0f} | {r['samples_per_s'] / 1e6:.2f}M |")
    rep = res.get("replay", {})
    if rep.get("rows"):
        lines += ["", "Replay (ms, median)", "| capacity | op | ours | flashbax | flashbax / ours |",
                  "| ---: | --- | ---: | ---: | ---: |"]
        for r in rep["rows"]:
            lines.append(f"| {r['capacity']:,} | {r['op']} | {_f(r['ours_ms'], '{:.3f}')} | "
                         f"{_f(r['flashbax_ms'], '{:.3f}')} | {_f(r['ratio'])} |")
    roof = res.get("roofline", {})
    if roof:
        lines += ["", f"Roofline per env step: Q-forward {roof['q_forward_flops']:,} FLOP, "
                      f"curiosity {roof['rnd_flops']:,} FLOP (bf16 x3 in bf16, else f32), "
                      f">= {roof['bytes_per_step']} B; "
                      f"floor {roof['floor_steps_per_s_bf16'] / 1e9:.2f}e9 env-steps/s in bf16 "
                      f"({roof['floor_steps_per_s_bf16_no_curiosity'] / 1e9:.2f}e9 without "
                      f"curiosity), {roof['floor_steps_per_s_f32'] / 1e9:.2f}e9 in f32"]
    return "\n".join(lines)


# --- entry points --------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="workload config (default: seed; quick: smoke)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="dotted config override (repeatable)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a CPU check of every path")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--variants", type=parse_variants, default=None,
                   help="backend:dtype list (default xla:float32,xla:bfloat16,pallas:bfloat16)")
    p.add_argument("--compile-variants", type=parse_variants, default=None,
                   help="variants for the compile section (default: --variants)")
    p.add_argument("--epochs", type=int, default=None, help="timed epochs (default 20; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed epochs first (default 2)")
    p.add_argument("--forward-n", type=parse_ints, default=None,
                   help="rows of the forward benchmark (default 1024,1048576)")
    p.add_argument("--forward-f32-kernel", action="store_true",
                   help="also time the float32 Pallas Q-forward (its compile takes minutes)")
    p.add_argument("--collect-n", type=parse_ints, default=None,
                   help="episode counts (default 1024,16384,262144,1048576)")
    p.add_argument("--collect-variants", type=parse_variants, default=None,
                   help="variants timed at N below the largest --collect-n (default: --variants)")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="skip the collection breakdown (no curiosity, no Q-forward) at the "
                        "largest N")
    p.add_argument("--experience-n", type=parse_ints, default=None,
                   help="N at which the whole experience phase is timed too (default 16384; the"
                        " seed section has N = 1024; its priority pass holds N*L activations)")
    p.add_argument("--big-batch", type=int, default=None, help="training batch (default 4096)")
    p.add_argument("--replay-capacities", default="2^20,2^22")
    p.add_argument("--replay-repeats", type=int, default=10, help="timed calls per replay op")
    p.add_argument("--kernel-configs", type=str, default="",
                   help="extra Pallas launch shapes to time, "
                        "layout:rows:warps[:min_rows[:max_chunk[:lookahead]]],... (the "
                        "curiosity kernel: each one's rows, warps and min_rows)")
    p.add_argument("--cmdbuf-variants", type=parse_variants,
                   default=parse_variants("xla:float32,pallas:bfloat16"),
                   help="variants of the command-buffer section (default xla:float32,"
                        "pallas:bfloat16)")
    p.add_argument("--time-budget", type=float, default=3600.0,
                   help="seconds; work that would start later is skipped and listed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="measure nothing: merge these JSONs of runs that split the sections "
                        "(each section from the last file with it) into --json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def _defaults(args) -> None:
    q = args.quick
    if args.config is None:
        args.config = "smoke" if q else "seed"
    if args.variants is None:
        args.variants = parse_variants(",".join(DEFAULT_VARIANTS))
    if args.epochs is None:
        args.epochs = 3 if q else 20
    if args.warmup is None:
        args.warmup = 1 if q else 2
    if args.forward_n is None:
        args.forward_n = (64, 256) if q else (1024, 1 << 20)
    if args.collect_n is None:
        args.collect_n = (16, 64) if q else (1024, 16384, 262144, 1048576)
    if args.experience_n is None:
        args.experience_n = (16,) if q else (16384,)
    if args.big_batch is None:
        args.big_batch = 128 if q else 4096
    if isinstance(args.kernel_configs, str):
        args.kernel_configs = parse_kernel_configs(args.kernel_configs) if args.kernel_configs else ()
    if args.epochs < (0 if args.child else 1) or args.warmup < 0:
        raise SystemExit("error: --epochs must be >= 1 and --warmup >= 0")
    if q and not args.child:
        # a CPU check of every code path: the smoke config shrunk further (compiles dominate)
        args.overrides = list(QUICK_OVERRIDES) + list(args.overrides)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="foxhunt-jax bench", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    return run(args, argv if argv is not None else sys.argv[1:])


def _command_line(argv) -> str:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["bench"]:
        words = words[1:]
    return " ".join(["foxhunt-jax", "bench"] + [shlex.quote(w) for w in words])


def merge(parts: list[tuple[str, dict]]) -> dict:
    """One result from the JSONs of runs that split the sections between them (a device that
    limits each command's time, say): ``parts`` is ``[(name, result), ...]`` in run order.

    Each section comes from the last part that has it; ``train`` gains the seed-batch rows of a
    seed section run in another part (:func:`seed_train_rows`); the roofline is recomputed
    from the merged device and forward sections. ``meta`` is the first part's, with every
    part's file, commit, date and command under ``meta.parts`` and ``meta.command`` listing the
    commands; ``meta.commit`` is the parts' commit, or ``"mixed"`` where they differ.
    """
    if not parts:
        raise SystemExit("error: bench --merge needs at least one JSON file")
    meta = dict(parts[0][1].get("meta", {}))
    meta["parts"] = [{"file": name, **{k: r.get("meta", {}).get(k)
                                       for k in ("commit", "date", "command")}}
                     for name, r in parts]
    meta["command"] = [p["command"] for p in meta["parts"]]
    commits = {p["commit"] for p in meta["parts"]}
    meta["commit"] = commits.pop() if len(commits) == 1 else "mixed"
    res: dict = {"meta": meta}
    for name in SECTIONS:
        for _, r in parts:
            if name in r:
                res[name] = r[name]
    meta["sections"] = [n for n in SECTIONS if n in res]
    if "train" in res and "seed" in res and not any(
            row.get("source") == "seed section" for row in res["train"].get("rows", [])):
        res["train"] = dict(res["train"], rows=seed_train_rows(res["seed"].get("rows", []))
                            + list(res["train"].get("rows", [])))
    args = argparse.Namespace(config=meta.get("config") or "seed",
                              overrides=list(meta.get("overrides") or []))
    res["roofline"] = roofline(res, args)
    return res


def check_bench_json(obj: Any, path: str) -> dict:
    """``obj`` if it is a result this command wrote (an object with a ``meta`` object holding
    commit, date and command, and at least one section, each an object); else FoxhuntError
    naming ``path``."""
    def refuse(why: str):
        raise FoxhuntError(f"bench --merge: {path} is not a bench result JSON: {why}")

    if not isinstance(obj, dict):
        refuse(f"it holds a JSON {type(obj).__name__}, not an object")
    meta = obj.get("meta")
    if not isinstance(meta, dict):
        refuse("no 'meta' object")
    missing = [k for k in ("commit", "date", "command") if k not in meta]
    if missing:
        refuse(f"'meta' lacks {', '.join(missing)}")
    sections = [name for name in SECTIONS if name in obj]
    if not sections:
        refuse(f"no section ({', '.join(SECTIONS)})")
    for name in sections:
        if not isinstance(obj[name], dict):
            refuse(f"section '{name}' is not an object")
    return obj


def read_bench_json(path: str) -> dict:
    """One ``--merge`` input: a regular file holding valid JSON that passes
    :func:`check_bench_json`; every failure is one FoxhuntError naming the file."""
    p = Path(path)
    if not p.is_file():  # is_file is False for a FIFO or device too, which must not be read
        why = "no such file" if not p.exists() else "not a regular file"
        raise FoxhuntError(f"bench --merge: cannot read {path}: {why}")
    try:
        obj = json.loads(p.read_bytes())
    except OSError as e:
        raise FoxhuntError(f"bench --merge: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise FoxhuntError(f"bench --merge: {path} is not valid JSON: {e}") from None
    return check_bench_json(obj, path)


def run_merge(args) -> dict:
    """``--merge A.json B.json ...``: :func:`merge`, its tables printed, written to ``--json``."""
    parts = [(Path(f).name, read_bench_json(f)) for f in args.merge]
    try:
        res = merge(parts)
        text = tables(res)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a field of another format
        raise FoxhuntError(f"bench --merge: {', '.join(args.merge)}: not the results of this "
                           f"version of the bench ({type(e).__name__}: {e})") from None
    print(text, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    return res


def run(args, argv=None) -> dict:
    if getattr(args, "merge", None):
        return run_merge(args)
    _defaults(args)
    if args.child:
        return child_main(args)
    from foxhunt_jax.jitcache import compilation_cache_in

    # In-process compiles start from a fresh persistent cache that only this run writes (the
    # compile section's children use cache folders of their own); the caller's cache settings
    # come back afterwards (a test process keeps its own folder).
    with tempfile.TemporaryDirectory(prefix="foxhunt-bench-main-") as tmp_cache, \
            compilation_cache_in(tmp_cache):
        return _run_sections(args, argv)


def _run_sections(args, argv) -> dict:
    """Every asked section in this process, in :data:`SECTIONS`' order; the JSON saved after
    each."""
    import jax

    from foxhunt_jax.data.loader import load_market

    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"error: unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    deadline = Deadline(args.time_budget)
    d = jax.devices()[0]
    res: dict = {"meta": {
        "date": datetime.date.today().isoformat(), "commit": git_commit(),
        "command": _command_line(argv),
        "device": f"{d.platform} ({getattr(d, 'device_kind', d.platform)}) x{len(jax.devices())}",
        "jax": jax.__version__, "backend": jax.default_backend(), "quick": bool(args.quick),
        "config": str(args.config), "overrides": list(args.overrides),
        "variants": [list(v) for v in args.variants], "sections": sections,
        "python": sys.version.split()[0],
        # what the programs compiled with: the library's options and the user's flags
        "xla_options": compiler_options(),
        "xla_options_training": compiler_options(training=True),
        "xla_flags": os.environ.get("XLA_FLAGS", "")}}

    def save():
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=2, default=str))

    cfg0 = _variant_cfg(args, "xla", "float32")
    market = load_market(cfg0.data.source, sort=cfg0.data.sort, synthetic=cfg0.data.synthetic)
    print(f"device: {res['meta']['device']}, jax {jax.__version__}", flush=True)
    for name in SECTIONS:  # fixed order
        if name not in sections:
            continue
        t0 = time.perf_counter()
        print(f"[{name}] ({deadline.left():.0f} s left)", flush=True)
        out = res.setdefault(name, {})
        if not deadline.ok(_SECTION_MIN_S.get(name, 0)):
            out["skipped"] = "time budget"
            continue
        try:
            if name == "device":
                section_device(args, out, deadline)
            elif name == "forward":
                section_forward(args, out, deadline, market)
            elif name == "seed":
                section_seed(args, out, deadline, market)
            elif name == "compile":
                section_compile(args, out, deadline)
            elif name == "cmdbuf":
                section_cmdbuf(args, out, deadline)
            elif name == "collect":
                section_collect(args, out, deadline, market, res.get("seed", {}).get("rows", []))
            elif name == "train":
                section_train(args, out, deadline, market, res.get("seed", {}).get("rows", []))
            elif name == "replay":
                section_replay(args, out, deadline)
        except Exception as e:  # keep the other sections' results
            out["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            traceback.print_exc()
        out["section_s"] = time.perf_counter() - t0
        res["roofline"] = roofline(res, args)
        save()
    print(tables(res), flush=True)
    save()
    return res


if __name__ == "__main__":
    main()
