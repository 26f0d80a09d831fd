"""Weak scaling over devices: collection and the whole epoch on 1 vs n devices.

Each device count ``n`` trains with ``n`` shards, ``n * N`` episodes of ``L`` steps, a global
batch of ``n * M`` and a replay buffer holding exactly one epoch (``L * N`` slots per shard), so
every device does the same work as the single device does alone. After ``--warmup`` epochs (the
first one compiles), ``--repeats`` epochs are timed; each phase is timed by the trainer with a
device sync (``block_until_ready``), the epoch also by the wall clock around ``run_epoch`` (host
metrics included). Weak-scaling efficiency is ``t(1) / t(n)`` of the medians.

Usage (a GPU machine; NCCL_NVLS_ENABLE=0 is kept set):
    python scripts/bench_scaling.py --devices 1,2 --json benchmarks/scaling.json
    python scripts/bench_scaling.py --episodes-per-device 64 --steps 10 --repeats 2 \\
        --set network.trunk=[16] --set network.head=8      # a quick check on a CPU

Prints a table and writes the JSON (configuration, per-epoch samples, medians, efficiencies).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts

import jax  # noqa: E402

from foxhunt_jax.config import load_config, to_dict  # noqa: E402
from foxhunt_jax.training.pipeline import PHASES  # noqa: E402
from foxhunt_jax.training.trainer import Trainer  # noqa: E402


def config_for(n: int, args: argparse.Namespace):
    """The weak-scaling config of ``n`` devices: every per-device size fixed."""
    per, steps = args.episodes_per_device, args.steps
    return load_config(args.config, [
        f"train.shards={n}", f"train.num_episodes={per * n}", f"env.episode_length={steps}",
        f"replay.capacity={steps * per * n}", f"train.batch_size={args.batch_per_device * n}",
        f"train.epochs={args.warmup + args.repeats}", *args.set])


def measure(n: int, args: argparse.Namespace) -> dict:
    cfg = config_for(n, args)
    t0 = time.perf_counter()
    trainer = Trainer.build(cfg, devices=jax.devices()[:n])
    state = trainer.init_state()
    trainer.compile(state)
    setup_s = time.perf_counter() - t0
    samples = []
    for i in range(args.warmup + args.repeats):
        t0 = time.perf_counter()
        state, rec = trainer.run_epoch(state)
        wall = (time.perf_counter() - t0) * 1e3
        if i >= args.warmup:
            ms = rec["phase_ms"]
            samples.append({**{k: ms[k] for k in PHASES},
                            "phases": sum(ms[k] for k in PHASES), "epoch_wall": wall,
                            "loss": rec["loss"]})
    del state, trainer
    gc.collect()
    med = {k: statistics.median(s[k] for s in samples)
           for k in (*PHASES, "phases", "epoch_wall")}
    env_steps = cfg.train.num_episodes * cfg.env.episode_length
    return {"devices": n, "shards": n, "episodes": cfg.train.num_episodes,
            "episode_length": cfg.env.episode_length, "batch_size": cfg.train.batch_size,
            "replay_capacity": cfg.replay.capacity, "setup_s": setup_s, "median_ms": med,
            "env_steps_per_s": env_steps / (med["experience"] / 1e3), "samples": samples}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="1,2", help="device counts to compare (first = baseline)")
    p.add_argument("--episodes-per-device", type=int, default=262_144)
    p.add_argument("--steps", type=int, default=100, help="L, steps per episode and epoch")
    p.add_argument("--batch-per-device", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--config", default="default")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.devices.split(",")]
    if max(counts) > jax.device_count():
        print(f"error: --devices asks for {max(counts)}, this machine has {jax.device_count()}",
              file=sys.stderr)
        return 2

    out = {"jax": jax.__version__, "device_kind": jax.devices()[0].device_kind,
           "platform": jax.devices()[0].platform, "args": vars(args),
           "config": to_dict(config_for(counts[0], args)), "runs": []}
    for n in counts:
        out["runs"].append(measure(n, args))
        base, cur = out["runs"][0]["median_ms"], out["runs"][-1]["median_ms"]
        out["runs"][-1]["efficiency"] = {k: base[k] / cur[k] for k in cur}
        if args.json:  # after every device count, so a cut-off run keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=2))

    print(f"{out['device_kind']} ({out['platform']}), jax {out['jax']}: N = "
          f"{args.episodes_per_device} episodes per device, L = {args.steps}, median of "
          f"{args.repeats} epochs after {args.warmup}")
    head = ("devices", "episodes", "experience ms", "training ms", "validation ms",
            "epoch ms (wall)", "eff. experience", "eff. epoch")
    print(" | ".join(head))
    for r in out["runs"]:
        m, e = r["median_ms"], r["efficiency"]
        print(" | ".join([str(r["devices"]), str(r["episodes"]), f"{m['experience']:.1f}",
                          f"{m['training']:.1f}", f"{m['validation']:.1f}",
                          f"{m['epoch_wall']:.1f}", f"{e['experience']:.1%}",
                          f"{e['epoch_wall']:.1%}"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
