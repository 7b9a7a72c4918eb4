"""What operators load next to the canary's metrics: a Grafana dashboard and Prometheus alerting rules, shipped
with the package (``docs/observability.md`` shows how to wire them).

:func:`dashboard_path` and :func:`rules_path` give the installed files; every query in them reads the metrics of
:mod:`kvcanary_cupy.integrations.common.metrics` (the tests check the names and labels against that list, and
the rules with ``promtool``).
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

#: The Grafana dashboard (import it, or provision it from this path).
DASHBOARD = "grafana-dashboard.json"
#: The Prometheus alerting rules (list the path under ``rule_files``).
RULES = "prometheus-rules.yml"


def dashboard_path() -> Path:
    """The installed Grafana dashboard JSON."""
    return _HERE / DASHBOARD


def rules_path() -> Path:
    """The installed Prometheus alerting rules file."""
    return _HERE / RULES
