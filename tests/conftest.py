"""Test-suite set-up: JAX's persistent compilation cache, so that the CLI subprocesses and the
in-process runs of one config compile each program once per machine, and the executable cache
(foxhunt_jax/jitcache.py), so that a program built again (another run of a config, a resume, the
report's walks) skips tracing and lowering too. A test that takes ``monkeypatch`` runs without
the executable cache: its keys cannot see a patched function (test_jitcache.py tests the cache
itself). A test whose patches change no function that a program traces (which programs are
built, or host code around them) is marked ``patches_host_code_only`` and keeps the cache."""

import os

os.environ.setdefault("FOXHUNT_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                        "foxhunt-jax", "xla-tests"))

import jax  # noqa: E402
import pytest  # noqa: E402
from _pytest.runner import runtestprotocol  # noqa: E402

from foxhunt_jax import jitcache  # noqa: E402
from foxhunt_jax.pystack import call_with_reserve  # noqa: E402

jitcache.enable_compilation_cache()
# every program the tests compile is stored, not only those over the library's 0.5 s: the suite
# compiles hundreds of small ones (eager ops, parity checks) that a warm run then loads
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
_EXECUTABLES = jitcache.executable_cache_folder()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """pytest's own protocol (set-up, call, tear-down, each logged), run in a reserved stack
    chunk (foxhunt_jax.pystack): the tests' tracing does not pay CPython 3.11's chunk mapping
    at every call."""
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    call_with_reserve(runtestprotocol, item, nextitem=nextitem)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


@pytest.fixture(autouse=True)
def executable_cache_unless_patched(request):
    """The executable cache as conftest set it, or off (also for the CLI, which turns it on in
    its process, and for its subprocesses) in a test that takes ``monkeypatch``, unless it is
    marked ``patches_host_code_only``; set back after every test."""
    if ("monkeypatch" in request.fixturenames
            and not request.node.get_closest_marker("patches_host_code_only")):
        patch = request.getfixturevalue("monkeypatch")
        patch.setenv("FOXHUNT_JAX_EXECUTABLE_CACHE", "off")
        jitcache.set_executable_cache(None)
    yield
    jitcache.set_executable_cache(_EXECUTABLES)


@pytest.fixture
def in_tmp_path(tmp_path):
    """``tmp_path`` as the working directory for the test, set back after (``monkeypatch.chdir``
    would turn the executable cache off)."""
    before = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(before)
