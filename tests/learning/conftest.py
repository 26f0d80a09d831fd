"""Every test here checks that the agent learns: each is marked ``slow``."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/learning/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.slow)
