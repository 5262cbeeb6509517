"""Fixtures of the unit tests: the Helm chart, loaded once, and its renders of every values case (test_helm_chart.py,
test_helm_placement.py); the toy family registered as a plug-in (test_toy_family.py, test_stage_loss.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def chart():
    import helm_python

    from tests.unit.helm_chart_support import CHART

    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def renders(chart):
    from tests.unit.helm_chart_support import CASES, _render

    return {case: _render(chart, values) for case, values in CASES.items()}


@pytest.fixture
def toy(monkeypatch):
    """The toy family (tests/toy_family), registered through the families' entry-point group for one test."""
    import importlib.metadata

    from omni_serve.graph import registry

    entry = importlib.metadata.EntryPoint(name="toy", value="tests.toy_family:FAMILY",
                                          group=registry.ENTRY_POINT_GROUP)
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None, **kw: [entry] if group == registry.ENTRY_POINT_GROUP
                        else real(group=group, **kw))
    registry.families.cache_clear()
    yield registry.family("toy")
    registry.families.cache_clear()
