"""Dashboards: renders spec.py into the committed Grafana dashboard JSON and Prometheus rule file.

The dashboard is built with Grafana's own dashboards-as-code library, the Foundation SDK
(PyPI ``grafana-foundation-sdk``, generated from Grafana's schema, so the JSON it writes has the
shape Grafana's dashboard schema declares). Run ``python -m dashboards.grafana.build`` after
editing spec.py; tests/test_grafana.py fails while the committed files differ from its output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from dashboards.grafana.spec import PANELS, SCENARIO_VARIABLE, Panel, render_rules_yaml

__all__ = ["DASHBOARD_JSON", "DASHBOARD_UID", "RULES_YAML", "build_dashboard", "main", "render_dashboard"]

HERE = Path(__file__).resolve().parent
DASHBOARD_JSON = HERE / "kvlens.json"
RULES_YAML = HERE / "kvlens-rules.yml"
DASHBOARD_UID = "kvlens-ledger"
_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _panel(p: Panel) -> Any:
    from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, table, timeseries
    from grafana_foundation_sdk.models import common as cm
    from grafana_foundation_sdk.models import dashboard as dm

    kinds: dict[str, Any] = {"timeseries": timeseries.Panel, "stat": stat.Panel, "table": table.Panel}
    builder = kinds[p.kind]()
    ds = dm.DataSourceRef(type_val=_DATASOURCE["type"], uid=_DATASOURCE["uid"])
    builder = builder.title(p.title).description(p.description).unit(p.unit).datasource(ds).height(8).span(12)
    for i, t in enumerate(p.targets):
        q = (prometheus.Dataquery().expr(t.expr).legend_format(t.legend).ref_id(chr(ord("A") + i))
             .datasource(ds))
        builder = builder.with_target(q.instant() if p.kind == "table" else q.range())
    if p.stacked:
        builder = builder.stacking(common.StackingConfig().mode(cm.StackingMode.NORMAL))
    if p.threshold is not None:
        steps = [dm.Threshold(value=None, color="green"), dm.Threshold(value=p.threshold, color="red")]
        config = dashboard.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps)
        builder = builder.thresholds(config)
        if p.kind == "timeseries":
            builder = builder.thresholds_style(
                common.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED))
    return builder


def build_dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (a dict), built with the Foundation SDK."""
    from grafana_foundation_sdk.builders import dashboard
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as dm

    ds = dm.DataSourceRef(type_val=_DATASOURCE["type"], uid=_DATASOURCE["uid"])
    board = (dashboard.Dashboard("kvlens: why each prompt token hit or was recomputed")
             .uid(DASHBOARD_UID).tags(["kvlens", "vllm", "kv-cache"]).refresh("1m").time("now-6h", "now")
             .timezone("browser")
             .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
             .with_variable(dashboard.QueryVariable("scenario").label("Scenario").datasource(ds)
                            .query(SCENARIO_VARIABLE).multi(True).include_all(True).all_value(".+")
                            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)))
    for p in PANELS:
        board = board.with_panel(_panel(p))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render_dashboard() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    DASHBOARD_JSON.write_text(render_dashboard())
    RULES_YAML.write_text(render_rules_yaml())
    print(f"wrote {DASHBOARD_JSON} and {RULES_YAML}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
