"""Test collection: with pytest-xdist (the CI command runs ``-n 2 --dist loadgroup``) every test marked
``distributed`` goes to one worker, one after another -- they start several processes each, and their
single-process references are cached per worker -- while the other worker takes the single-process tests."""
from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)     # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.xdist_group("distributed"))
