"""Epoch records compared across runs: everything but the wall-clock phase timings."""


def without_timing(records: list[dict]) -> list[dict]:
    """``records`` without their ``phase_ms`` (times differ from run to run; the rest must not)."""
    return [{k: v for k, v in r.items() if k != "phase_ms"} for r in records]
