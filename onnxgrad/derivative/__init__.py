"""derivative layer (see the package docstring)."""

__all__: list[str] = []
