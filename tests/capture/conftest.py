"""Shared captures (each costs an export), cached for the whole session."""

from __future__ import annotations

import functools
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@functools.cache
def _spec_graph(name: str):
    from autoplan.capture import capture_spec

    return capture_spec(name)


@pytest.fixture(scope="session")
def spec_graph():
    """spec_graph("tiny-gpt") -> ModelGraph of the zoo model, captured once per session."""
    return _spec_graph
