"""Dashboards: the Streamlit pages, one ``render(ctx)`` function per page, grouped by theme."""

__all__: list[str] = []
