"""The ``policy`` section: the latency of a live decision (:mod:`foxhunt_jax.policy.latency`),
one step for 1 and for 1,000 instruments, through the library and through the export.

The agent is the workload config's network after one short epoch (its weights do not change the
time); the run and its export live in a temporary folder."""

from __future__ import annotations

import tempfile
from pathlib import Path

from foxhunt_jax import api
from foxhunt_jax.bench.common import Deadline, variant_cfg
from foxhunt_jax.policy import latency

# one short epoch: what the section times is the decision, not the training
SHORT_RUN = ("train.epochs=1", "train.num_episodes=16", "env.episode_length=8",
             "train.train_steps=1", "train.batch_size=16", "train.validation_windows=4",
             "replay.capacity=1024", "train.checkpoint_every=1")


def section_policy(args, out: dict, deadline: Deadline) -> None:
    """Per variant (``--quick``: the first), rows of the median and 99th percentile of one
    library ``Policy.step`` and one exported step, for 1 and 1,000 instruments."""
    calls = 20 if args.quick else 500
    out["rows"] = []
    for backend, dtype in args.variants[:1] if args.quick else args.variants:
        if not deadline.ok(20):
            out.setdefault("skipped", []).append(f"{backend}/{dtype}: time budget")
            continue
        cfg = variant_cfg(args, backend, dtype, list(SHORT_RUN))
        with tempfile.TemporaryDirectory(prefix="foxhunt-bench-policy-") as tmp:
            run = Path(tmp) / "run"
            api.train(cfg, run, progress=False, final_report=False, log=lambda line: None)
            res = latency.measure(run, instruments=(1, 1000), calls=calls)
        for path in ("library", "exported"):
            for n, stats in res[path].items():
                out["rows"].append({"backend": backend, "dtype": dtype, "path": path,
                                    "instruments": int(n), **stats})
        print(f"  policy {backend}/{dtype}: " + ", ".join(
            f"{r['path']} N={r['instruments']} {r['median_us']:.0f} us (p99 {r['p99_us']:.0f})"
            for r in out["rows"] if (r["backend"], r["dtype"]) == (backend, dtype)), flush=True)
