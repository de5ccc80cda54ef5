"""wtcore-ray-client: a wtcore plugin (work in progress)."""

__all__: list[str] = []
