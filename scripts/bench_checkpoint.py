"""How long a checkpoint save takes: packed (the library's format) against array by array.

    python scripts/bench_checkpoint.py [--config seed] [--saves 8] [--json out.json]

Saves the config's initial ``TrainerState`` ``--saves`` times into fresh temporary directories,
once as :func:`foxhunt_jax.training.checkpoint.save` writes it (small replicated arrays packed
into one vector per dtype and placement) and once array by array (packing turned off, the
format before 2026-11-30). It then times orbax on its own for 15 MB split into as many arrays
as the state has, for the same arrays at 16 bytes each, and for one 15 MB array: orbax's cost
grows with the number of arrays more than with their bytes. Prints milliseconds per save; the
first save of a process also compiles the packing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout


def _times(save, count: int) -> list[float]:
    out = []
    with tempfile.TemporaryDirectory(prefix="foxhunt-ckpt-") as tmp:
        for step in range(1, count + 1):
            t0 = time.perf_counter()
            save(tmp, step)
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="seed")
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from foxhunt_jax.config import load_config
    from foxhunt_jax.training import checkpoint
    from foxhunt_jax.training.trainer import Trainer

    state = Trainer.build(load_config(args.config)).init_state()
    leaves = jax.tree.leaves(state)
    res = {"config": args.config, "arrays": len(leaves),
           "mb": sum(x.nbytes for x in leaves) / 1e6, "ms": {}}
    print(f"{args.config}: {res['arrays']} arrays, {res['mb']:.1f} MB", flush=True)

    def state_save(tmp, step):
        checkpoint.save(tmp, step, state, {"epoch": step})

    real = checkpoint._pack_group
    res["ms"]["packed"] = _times(state_save, args.saves)
    checkpoint._pack_group = lambda value: None  # every array by itself, as before packing
    try:
        res["ms"]["array_by_array"] = _times(state_save, args.saves)
    finally:
        checkpoint._pack_group = real

    n, total = len(leaves), 15_000_000 // 4
    payloads = {f"orbax_{n}_arrays_15mb": {f"a{i}": jnp.zeros((total // n,)) for i in range(n)},
                f"orbax_{n}_arrays_16b": {f"a{i}": jnp.zeros((4,)) for i in range(n)},
                "orbax_1_array_15mb": {"a": jnp.zeros((total,))}}
    for name, payload in payloads.items():
        def orbax_save(tmp, step, _p=payload):
            mgr = checkpoint._manager(tmp)
            try:
                mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_p)),
                         force=True)
                mgr.wait_until_finished()
            finally:
                mgr.close()
        res["ms"][name] = _times(orbax_save, max(3, args.saves // 2))

    for name, ts in res["ms"].items():
        rest = ts[1:] or ts
        print(f"  {name}: first {ts[0]:.0f} ms, then median {statistics.median(rest):.0f} "
              f"[{min(rest):.0f}-{max(rest):.0f}] ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
