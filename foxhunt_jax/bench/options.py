"""The command line of ``foxhunt-jax bench``: its options and their value parsers.

Imports nothing heavy, so that building the CLI's parser does not load JAX.
"""

from __future__ import annotations

import argparse

# in this order: the seed section compiles first, in this process
SECTIONS = ("seed", "compile", "device", "forward", "collect", "train", "replay", "policy",
            "cmdbuf", "population")
DEFAULT_VARIANTS = "xla:float32,xla:bfloat16,pallas:bfloat16"


def parse_sections(text: str) -> tuple[str, ...]:
    """``"seed,forward"`` -> the named sections, each one of :data:`SECTIONS`."""
    out = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in out if s not in SECTIONS]
    if unknown or not out:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown or [text]}; known: "
                                         f"{','.join(SECTIONS)}")
    return out


def parse_variants(text: str) -> tuple[tuple[str, str], ...]:
    """``"xla:f32,pallas:bf16"`` -> ``(("xla", "float32"), ("pallas", "bfloat16"))``."""
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
    """``"1024,1_048_576"`` -> ``(1024, 1048576)``; positive integers only."""
    try:
        out = tuple(int(float(t)) for t in text.replace("_", "").split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got '{text}'")
    return out


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="workload config (default: seed; quick: smoke)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="dotted config override (repeatable)")
    p.add_argument("--json", default=None, help="write the results here (default: none, the "
                                                "tables are printed only)")
    p.add_argument("--quick", action="store_true",
                   help="every section at tiny sizes: a check of every code path, in minutes on "
                        "a CPU (default: off)")
    p.add_argument("--sections", type=parse_sections, default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--variants", type=parse_variants, default=None,
                   help=f"backend:dtype list (default {DEFAULT_VARIANTS}; quick xla:float32,"
                        "pallas:bfloat16)")
    p.add_argument("--compile-variants", type=parse_variants, default=None,
                   help="variants for the compile section (default: --variants; quick: the first)")
    p.add_argument("--epochs", type=int, default=None, help="timed epochs (default 20; quick 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed epochs first (default 2; quick 1)")
    p.add_argument("--forward-n", type=parse_ints, default=None,
                   help="rows of the forward benchmark (default 1024,1048576; quick 64)")
    p.add_argument("--forward-f32-kernel", action="store_true",
                   help="also time the float32 Pallas Q-forward (its compile takes minutes; "
                        "default: off)")
    p.add_argument("--collect-n", type=parse_ints, default=None,
                   help="episode counts (default 1024,16384,262144,1048576; quick 16)")
    p.add_argument("--collect-variants", type=parse_variants, default=None,
                   help="variants timed at N below the largest --collect-n (default: --variants)")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="skip the collection breakdown (no curiosity, no Q-forward) at the "
                        "largest N (default: the breakdown runs)")
    p.add_argument("--experience-n", type=parse_ints, default=None,
                   help="N at which the whole experience phase is timed too (default 16384, quick"
                        " none; the seed section has N = 1024; its priority pass holds N*L"
                        " activations)")
    p.add_argument("--big-batch", type=int, default=None, help="training batch (default 4096; quick 128)")
    p.add_argument("--replay-capacities", type=parse_capacities, default="2^20,2^22",
                   help="replay buffer capacities, e.g. 2^20,4194304 (default 2^20,2^22)")
    p.add_argument("--replay-repeats", type=int, default=10,
                   help="timed calls per replay op (default 10)")
    p.add_argument("--kernel-configs", type=str, default="",
                   help="extra Pallas launch shapes to time, "
                        "layout:rows:warps[:min_rows[:max_chunk[:lookahead]]],... (the "
                        "curiosity kernel: each one's rows, warps and min_rows; default: none)")
    p.add_argument("--cmdbuf-variants", type=parse_variants,
                   default=parse_variants("xla:float32,pallas:bfloat16"),
                   help="variants of the command-buffer section (default xla:float32,"
                        "pallas:bfloat16)")
    p.add_argument("--population-sizes", type=parse_ints, default=None,
                   help="members P of the population section (default 1,8,64; add 256 where "
                        "memory allows; quick 1,2)")
    p.add_argument("--time-budget", type=float, default=3600.0,
                   help="seconds; work that would start later is skipped and listed "
                        "(default 3600)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random inputs the sections time (default 0)")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="measure nothing: merge these JSONs of runs that split the sections "
                        "(each section from the last file with it) into --json (default: none)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


