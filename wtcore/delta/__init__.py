"""Delta rounds: send only what changed since the receivers' version (see docs/architecture.md)."""
