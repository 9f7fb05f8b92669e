"""Benchmarks time one process at a time: the test suite's `-n auto` (pyproject.toml) would
spread them over pytest-xdist's workers, where pytest-benchmark turns itself off."""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    config.option.numprocesses = 0
