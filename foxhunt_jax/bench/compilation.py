"""The ``compile`` section: the whole epoch's compile per variant in fresh processes: cold (an
empty cache folder of its own), then from the caches it filled (JAX's persistent cache alone,
and with the library's executable cache). ``--quick`` checks the path, not the times: its
processes share the caller's cache folder, which the sections before filled, so nothing in
them compiles cold (a cold compile is most of a quick run on a CPU)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax

from foxhunt_jax.bench.child import child_cmd, child_env, report_child, run_child
from foxhunt_jax.bench.common import Deadline


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
    shared = jax.config.jax_compilation_cache_dir if args.quick else None
    out["cold"]["source"] = ("--quick: the caller's cache folder" if shared else
                             "a fresh process per variant with an empty cache folder")
    for variant in variants:
        label = "{}/{}".format(*variant)
        with tempfile.TemporaryDirectory(prefix="foxhunt-bench-compile-") as fresh:
            cache = shared or fresh
            # a step that is not run, or fails, skips the later ones: each reads the cache the
            # ones before it fill
            for k, (name, extra) in enumerate(steps):
                if not deadline.ok(20):
                    skipped = steps[k:]
                    break
                res = run_child(child_cmd(args, [variant], Path(fresh) / f"{name}.json", 0),
                                child_env(FOXHUNT_JAX_CACHE=cache, **extra),
                                deadline.left() - 10)
                report_child(name, res)
                if "error" in res:
                    out[name]["error"] = f"{label}: {res['error']}"
                    skipped = steps[k + 1:]
                    break
                out[name]["rows"] += res.get("rows", [])
            else:
                skipped = ()
            for later, _ in skipped:
                out[later].setdefault("skipped", []).append(label)


