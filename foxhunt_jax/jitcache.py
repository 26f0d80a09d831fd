"""JAX's persistent compilation cache for the command line and the tests.

Compiling the three phase programs dominates start-up on a CPU; with the cache a second run of
the same config loads them from disk. ``FOXHUNT_JAX_CACHE=DIR`` picks the folder (default
``~/.cache/foxhunt-jax/xla``); ``FOXHUNT_JAX_CACHE=off`` turns it off. Library users who import
foxhunt_jax keep their own JAX settings: only the CLI and the test suite call this.
"""

from __future__ import annotations

import os
from pathlib import Path


def enable_compilation_cache(path: str | None = None) -> str | None:
    where = path or os.environ.get("FOXHUNT_JAX_CACHE") or str(Path.home() / ".cache/foxhunt-jax/xla")
    if where.lower() == "off":
        return None
    import jax

    Path(where).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where
