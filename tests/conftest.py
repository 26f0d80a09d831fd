"""Test-suite set-up: JAX's persistent compilation cache, so that the CLI subprocesses and the
in-process runs of one config compile each program once per machine. The executable cache stays
off in this process: tests monkeypatch library functions, which its keys cannot see (the CLI
subprocesses use it; test_jitcache.py tests it)."""

import os

os.environ.setdefault("FOXHUNT_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                        "foxhunt-jax", "xla-tests"))

import jax  # noqa: E402

from foxhunt_jax.jitcache import enable_compilation_cache  # noqa: E402

enable_compilation_cache(executables=False)
# every program the tests compile is stored, not only those over the library's 0.5 s: the suite
# compiles hundreds of small ones (eager ops, parity checks) that a warm run then loads
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
