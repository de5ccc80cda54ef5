"""wtcore's kit: what engines and clients are built from, and the built-in ``inline`` and
``inproc`` built on it (docs/architecture.md, "Where things live").

``wtcore`` is the protocol and imports nothing from here. Import the module you use.
"""

__all__: list[str] = []
