"""foxhunt_jax.pystack: calls under the reserve do not map a stack chunk at every call."""

import resource
import sys
import threading

import pytest

from foxhunt_jax.pystack import call_with_reserve

CALLS = 2000


def _page_faults_of_a_loop_at_depth(depth: int) -> int:
    """Minor page faults of the process while a loop of CALLS calls runs ``depth`` frames
    below the caller (a chunk mapped afresh is touched, and so faults, once a call)."""
    def leaf(a, b, c, d):
        return a

    def loop():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(CALLS):
            leaf(1, 2, 3, 4)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    def down(d):
        return loop() if d == 0 else down(d - 1)
    return down(depth)


def _worst_depth_in_a_new_thread(reserve: bool) -> int:
    """The most page faults a loop takes over depths 0-399, in a thread of its own (a fresh
    frame stack, whatever the caller's), with or without the reserve."""
    def scan():
        return max(_page_faults_of_a_loop_at_depth(d) for d in range(400))
    box = {}
    thread = threading.Thread(
        target=lambda: box.update(worst=call_with_reserve(scan) if reserve else scan()))
    thread.start()
    thread.join()
    return box["worst"]


def test_calls_under_the_reserve_map_no_chunk_at_any_depth():
    assert _worst_depth_in_a_new_thread(reserve=True) < CALLS // 10
    if sys.implementation.name == "cpython" and sys.version_info[:2] in ((3, 11), (3, 12)):
        # the cost the reserve removes: at some depth every call maps a chunk and faults
        assert _worst_depth_in_a_new_thread(reserve=False) >= CALLS // 2


def test_call_with_reserve_passes_arguments_and_the_result_and_raises_what_fn_raises():
    assert call_with_reserve(lambda a, b=0: (a, b), 1, b=2) == (1, 2)
    with pytest.raises(ValueError, match="not a number"):
        call_with_reserve(int, "not a number")
