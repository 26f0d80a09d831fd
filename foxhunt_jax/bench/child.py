"""Fresh processes for the sections that time a start from nothing (``compile``, ``cmdbuf``):
``python -m foxhunt_jax.bench --child ...`` builds, compiles and optionally times each variant
and writes its JSON; the parent reads it back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax

from foxhunt_jax.bench.common import PACKAGE_ROOT, build_trainer, spread, variant_cfg
from foxhunt_jax.bench.seed import time_epochs
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.files import write_atomic
from foxhunt_jax.jitcache import enable_compilation_cache


def child_cmd(args, variants, json_path: Path, epochs: int) -> list[str]:
    """The command of a fresh process that builds, compiles and times ``variants`` (``epochs``
    epochs after one warm-up) and writes its result to ``json_path``."""
    cmd = [sys.executable, "-m", "foxhunt_jax.bench", "--child", "--config", str(args.config),
           "--variants", ",".join(f"{b}:{d}" for b, d in variants), "--json", str(json_path),
           "--epochs", str(epochs), "--warmup", "1"]
    for o in args.overrides:
        cmd += ["--set", o]
    return cmd


def run_child(cmd, env, timeout: float) -> dict:
    """Runs ``cmd`` (:func:`child_cmd`) and returns its JSON with its wall time, or
    ``{"error": ...}``."""
    t0 = time.perf_counter()
    json_path = Path(cmd[cmd.index("--json") + 1])
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not json_path.exists():
        return {"error": f"exit {proc.returncode}: {(proc.stderr or '')[-600:]}"}
    res = json.loads(json_path.read_text())
    res["process_wall_s"] = wall
    return res


def child_env(**extra) -> dict:
    """This process's environment for a child, with ``extra`` set."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PACKAGE_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    # the parent holds device memory: a child must not try to take most of it up front
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.update(extra)
    return env


def report_child(name: str, res: dict) -> None:
    """One line per variant of a child's result: its compile, init and epoch times."""
    for row in res.get("rows", []):
        extra = ""
        if "phases" in row:
            extra = f", epoch {row['phases']['total']['median']:.2f} ms"
        print(f"  {name} {row['backend']}/{row['dtype']}: compile "
              f"{row.get('compile_ms', float('nan')) / 1e3:.2f} s (init "
              f"{row.get('init_ms', float('nan')) / 1e3:.2f} s){extra}", flush=True)
    if "error" in res:
        print(f"  {name}: FAILED {res['error'][-300:]}", flush=True)


def child_main(args) -> dict:
    """A fresh process: build, init and compile each variant (+ ``--epochs`` epochs).

    ``jax_startup_s`` is the JAX backend's initialisation, after the cache is turned on."""
    t_start = time.perf_counter()
    cache = enable_compilation_cache()
    jax.devices()
    startup = time.perf_counter() - t_start
    rows = []
    market = None
    for backend, dtype in args.variants:
        cfg = variant_cfg(args, backend, dtype)
        if market is None:
            market = load_market(cfg.data.source, sort=cfg.data.sort, synthetic=cfg.data.synthetic)
        tr = build_trainer(cfg, market)
        state = tr.init_state()
        init_ms = tr.init_ms
        tr.compile(state, queued=True)  # the programs of queued epochs, as the seed section's
        row = {"backend": backend, "dtype": dtype, "init_ms": init_ms,
               "compile_ms": tr.compile_ms, "executables_loaded": tr.executables_loaded,
               "programs": len(tr.pipeline.programs)}
        if args.epochs > 0:
            tr.init_ms = tr.compile_ms = 0.0
            phases, _, _ = time_epochs(tr, state, args.epochs, args.warmup)
            row["phases"] = {k: spread(v) for k, v in phases.items()}
        rows.append(row)
    res = {"cache": cache, "jax_startup_s": startup, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "rows": rows}
    if args.json:
        write_atomic(args.json, json.dumps(res, indent=2))
    return res

