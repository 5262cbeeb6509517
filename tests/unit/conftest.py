"""Fixtures of the Helm chart tests (test_helm_chart.py, test_helm_placement.py): the chart, loaded once,
and its renders of every values case."""

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
