"""Dashboards: read the analysis DB only (Streamlit pages, the report)."""

__all__: list[str] = []
