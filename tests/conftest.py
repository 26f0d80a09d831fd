"""Test-suite set-up: XLA's CPU flags for fast compiles, JAX's persistent compilation cache, so that the CLI subprocesses and the
in-process runs of one config compile each program once per machine. The executable cache stays
off in this process: tests monkeypatch library functions, which its keys cannot see (the CLI
subprocesses use it; test_jitcache.py tests it)."""

import os

# The suite's programs are tiny and run once or a few times: compiling is what takes its time,
# so XLA's CPU backend skips its slowest optimizations (the same arithmetic, less tuned code).
# A caller's own XLA_FLAGS come first and win.
os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 "
                           "--xla_llvm_disable_expensive_passes=true "
                           + os.environ.get("XLA_FLAGS", "")).strip()
os.environ.setdefault("FOXHUNT_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                        "foxhunt-jax", "xla-tests"))

from foxhunt_jax.jitcache import enable_compilation_cache  # noqa: E402

enable_compilation_cache(executables=False)
