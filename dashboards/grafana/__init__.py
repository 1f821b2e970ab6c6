"""Dashboards: the Grafana dashboard and Prometheus alerting rules over ``kvlens export`` and vLLM's /metrics.

spec.py declares every panel's PromQL and every rule once; build.py renders them (the dashboard
through Grafana's own Foundation SDK) into the committed kvlens.json and kvlens-rules.yml.
"""
