"""GPU probe: measurements -> probe_runs rows; torch is imported inside functions."""

__all__: list[str] = []
