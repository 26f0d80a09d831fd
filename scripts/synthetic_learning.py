"""It learns: the trading agent against the oracle on the synthetic market.

Trains ``configs/synthetic.yaml`` (a market with a planted AR(1) signal, ``builtin:synthetic``)
through the library API once per seed, walks the held-out test split greedily, and prints the
agent's Sharpe ratio next to the oracle's (long after an up bar, short after a down bar: the
policy that knows the signal). Ends with one line per seed:

    seed=<int> agent_sharpe=<float> oracle_sharpe=<float> ratio=<float> seconds=<float>

and exits with status 1 when any ratio is below ``--min-ratio`` (0.8).

Usage: python scripts/synthetic_learning.py [--seeds 0 1] [--out DIR] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from foxhunt_jax import api
from foxhunt_jax.config import load_config
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.jitcache import enable_compilation_cache

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "synthetic.yaml"


def test_sharpes(summary: dict) -> tuple[float, float]:
    """(agent, oracle) Sharpe ratios of the test split from a train summary."""
    test = summary["test"]
    if "oracle" not in test:
        raise ConfigError("data.source must be [builtin:synthetic] for the oracle comparison, "
                          "the config trains on other data")
    return float(test["agent"]["sharpe"]), float(test["oracle"]["sharpe"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="train.seed values")
    ap.add_argument("--out", default=None, help="run directories go to OUT/seed<k> (optional)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="config override, repeatable")
    ap.add_argument("--min-ratio", type=float, default=0.8)
    ap.add_argument("--quiet", action="store_true", help="only the result lines")
    args = ap.parse_args(argv)
    enable_compilation_cache()

    lines, ok = [], True
    for seed in args.seeds:
        cfg = load_config(args.config, [*args.overrides, f"train.seed={seed}"])
        out = Path(args.out) / f"seed{seed}" if args.out else None
        t0 = time.perf_counter()
        res = api.train(cfg, out, progress=False, log=(lambda s: None) if args.quiet else None)
        seconds = time.perf_counter() - t0
        agent, oracle = test_sharpes(res.summary)
        ratio = agent / oracle if oracle > 0 else float("nan")
        ok &= ratio >= args.min_ratio  # a NaN ratio (oracle without edge) fails
        lines.append(f"seed={seed} agent_sharpe={agent:.3f} oracle_sharpe={oracle:.3f} "
                     f"ratio={ratio:.3f} seconds={seconds:.1f}")
        print(lines[-1], flush=True)
    if len(lines) > 1:
        print("\n".join(["summary:"] + lines))
    if not ok:
        print(f"FAIL: the agent's test Sharpe is below {args.min_ratio:.0%} of the oracle's",
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
