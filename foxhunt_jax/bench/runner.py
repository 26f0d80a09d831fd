"""Runs the asked sections in order, keeps each one's result (or its error) and writes the JSON
after every section, so that a run cut short keeps what it measured."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax

from foxhunt_jax.bench import (child, cmdbuf, collect, compilation, device, forward, policy,
                               population, replay, seed, train)
from foxhunt_jax.bench.common import Deadline, git_commit, parse_kernel_configs, variant_cfg
from foxhunt_jax.bench.options import DEFAULT_VARIANTS, SECTIONS, add_arguments, parse_variants
from foxhunt_jax.bench.report import roofline, run_merge, tables, wrote_line
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.files import write_atomic
from foxhunt_jax.jitcache import compilation_cache_in, compiler_options

# --quick: the smoke config shrunk further, so that every code path runs in seconds on a CPU
QUICK_OVERRIDES = ("network.trunk=[32]", "network.head=16", "env.episode_length=8",
                   "train.num_episodes=16", "train.train_steps=2", "train.batch_size=16",
                   "train.validation_windows=4", "replay.capacity=1024", "curiosity.hidden=16",
                   "curiosity.embed=8")
QUICK_VARIANTS = "xla:float32,pallas:bfloat16"
# seconds a section needs to be worth starting (the replay comparison has no budget of its own)
SECTION_MIN_S = {"replay": 40, "train": 25, "cmdbuf": 40, "compile": 15, "policy": 20}


def apply_defaults(args) -> None:
    """Fills the options left unset with the full run's sizes, or the tiny ones of ``--quick``:
    one size of each kind, both backends and both precisions (``xla:float32,pallas:bfloat16``),
    the compile section's fresh processes for the first variant only, and no separate timing of
    the experience phase."""
    q = args.quick
    if args.config is None:
        args.config = "smoke" if q else "seed"
    if args.variants is None:
        args.variants = parse_variants(QUICK_VARIANTS if q else DEFAULT_VARIANTS)
    if args.compile_variants is None and q:
        args.compile_variants = args.variants[:1]
    if args.epochs is None:
        args.epochs = 2 if q else 20
    if args.warmup is None:
        args.warmup = 1 if q else 2
    if args.forward_n is None:
        args.forward_n = (64,) if q else (1024, 1 << 20)
    if args.collect_n is None:
        args.collect_n = (16,) if q else (1024, 16384, 262144, 1048576)
    if args.experience_n is None:
        # --quick: the seed section's experience rows are that phase at the same N already
        args.experience_n = () if q else (16384,)
    if args.population_sizes is None:
        args.population_sizes = (1, 2) if q else (1, 8, 64)
    if args.big_batch is None:
        args.big_batch = 128 if q else 4096
    if isinstance(args.kernel_configs, str):
        args.kernel_configs = parse_kernel_configs(args.kernel_configs) if args.kernel_configs else ()
    if args.epochs < (0 if args.child else 1) or args.warmup < 0:
        raise ConfigError("--epochs must be >= 1 and --warmup >= 0")
    if q and not args.child:
        args.overrides = list(QUICK_OVERRIDES) + list(args.overrides)


def main(argv: list[str] | None = None) -> dict:
    """``python -m foxhunt_jax.bench ...``: the same as ``foxhunt-jax bench ...``."""
    ap = argparse.ArgumentParser(prog="foxhunt-jax bench",
                                 description="time every phase on this device")
    add_arguments(ap)
    args = ap.parse_args(argv)
    return run(args, argv if argv is not None else sys.argv[1:])


def command_line(argv) -> str:
    """The command that reproduces this run, as the JSON records it."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["bench"]:
        words = words[1:]
    return " ".join(["foxhunt-jax", "bench"] + [shlex.quote(w) for w in words])


def run(args, argv=None) -> dict:
    """``foxhunt-jax bench`` with parsed ``args``: a merge, a child process's work, or the run."""
    if getattr(args, "merge", None):
        return run_merge(args)
    apply_defaults(args)
    if args.child:
        return child.child_main(args)
    if args.quick:  # a check of every code path: its timings mean nothing, so the caller's
        return run_sections(args, argv)  # compile cache may serve it
    # In-process compiles start from a fresh persistent cache that only this run writes (the
    # compile section's children use cache folders of their own); the caller's cache settings
    # come back afterwards (a test process keeps its own folder).
    with tempfile.TemporaryDirectory(prefix="foxhunt-bench-main-") as tmp_cache, \
            compilation_cache_in(tmp_cache):
        return run_sections(args, argv)


def run_section(name: str, args, out: dict, deadline: Deadline, market, res: dict) -> None:
    """One section by name into ``out`` (``res``: the sections measured before it)."""
    seed_rows = res.get("seed", {}).get("rows", [])
    if name == "seed":
        seed.section_seed(args, out, deadline, market)
    elif name == "compile":
        compilation.section_compile(args, out, deadline)
    elif name == "device":
        device.section_device(args, out, deadline)
    elif name == "forward":
        forward.section_forward(args, out, deadline, market)
    elif name == "collect":
        collect.section_collect(args, out, deadline, market, seed_rows)
    elif name == "train":
        train.section_train(args, out, deadline, market, seed_rows)
    elif name == "replay":
        replay.section_replay(args, out, deadline)
    elif name == "policy":
        policy.section_policy(args, out, deadline)
    elif name == "cmdbuf":
        cmdbuf.section_cmdbuf(args, out, deadline)
    elif name == "population":
        population.section_population(args, out, deadline, market)


def run_sections(args, argv) -> dict:
    """Every asked section in this process, in :data:`SECTIONS`' order; the JSON saved after
    each."""
    sections = list(args.sections)
    deadline = Deadline(args.time_budget)
    d = jax.devices()[0]
    res: dict = {"meta": {
        "date": datetime.date.today().isoformat(), "commit": git_commit(),
        "command": command_line(argv),
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
            write_atomic(args.json, json.dumps(res, indent=2, default=str))

    cfg0 = variant_cfg(args, "xla", "float32")
    market = load_market(cfg0.data.source, sort=cfg0.data.sort, synthetic=cfg0.data.synthetic)
    print(f"device: {res['meta']['device']}, jax {jax.__version__}", flush=True)
    for name in SECTIONS:  # fixed order
        if name not in sections:
            continue
        t0 = time.perf_counter()
        print(f"[{name}] ({deadline.left():.0f} s left)", flush=True)
        out = res.setdefault(name, {})
        if not deadline.ok(SECTION_MIN_S.get(name, 0)):
            out["skipped"] = "time budget"
            continue
        try:
            run_section(name, args, out, deadline, market, res)
        except Exception as e:  # keep the other sections' results
            out["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            traceback.print_exc()
        out["section_s"] = time.perf_counter() - t0
        res["roofline"] = roofline(res, args)
        save()
    print(tables(res), flush=True)
    save()
    print(wrote_line(args.json), flush=True)
    return res
