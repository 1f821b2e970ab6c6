"""Dashboards: the Streamlit pages, one module per page, each with one ``render``-style function
(``overview(ctx)``, ``misses(ctx)``, ...) that dashboards/app.py lists."""

__all__: list[str] = []
