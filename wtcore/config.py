"""Config by name: one dict (from JSON or TOML) builds a trainer engine and its client.

Unknown keys are refused, listing the valid ones, before anything starts.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError
from wtcore.parse import parse_dataclass
from wtcore.registry import CLIENTS, TRAINER_ENGINES

if TYPE_CHECKING:
    from wtcore.client import WeightSyncClient
    from wtcore.source import WeightSource
    from wtcore.trainer import TrainerWeightTransferEngine

__all__ = ["build_client", "load_config", "trainer_from_config"]


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a ``.json`` or ``.toml`` config file (any failure a :class:`PayloadError`)."""
    p = Path(path)
    if p.suffix not in (".toml", ".json"):
        raise PayloadError(f"config file must end in .json or .toml, got {p.name!r}")
    try:
        text = p.read_text()
    except FileNotFoundError as e:
        raise PayloadError(f"config: {p}: no such file") from e
    except OSError as e:
        raise PayloadError(f"config: {p} cannot be read ({e.strerror or e})") from e
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        data: Any = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise PayloadError(f"config: {p} is not valid {p.suffix[1:].upper()} ({e})") from e
    if not isinstance(data, dict):
        raise PayloadError(
            f"config: expected a table/object at the top of {p}, got {type(data).__name__}"
        )
    return data


def build_client(spec: Mapping[str, Any]) -> WeightSyncClient:
    """Build a client from ``{"name": ..., **kwargs}``."""
    if not isinstance(spec, Mapping):
        raise PayloadError(f"config.client: expected an object with a 'name', got {spec!r}")
    kwargs = dict(spec)
    name = kwargs.pop("name", None)
    if not isinstance(name, str):
        raise PayloadError(f"config.client.name: expected a client name, got {name!r}")
    cls = CLIENTS.load(name)
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    valid = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown and not takes_any:
        raise PayloadError(
            f"config.client: unknown key(s) {', '.join(map(repr, unknown))} for client "
            f"{name!r}; valid keys: name, {', '.join(valid)}"
        )
    try:
        client: WeightSyncClient = cls(**kwargs)
    except TypeError as e:
        raise PayloadError(f"config.client: {e}") from e
    return client


def trainer_from_config(
    config: Mapping[str, Any] | str | Path,
    *,
    rank: int = 0,
    source: WeightSource | None = None,
    client: WeightSyncClient | None = None,
) -> TrainerWeightTransferEngine:
    """Build the trainer engine named by ``config["backend"]`` and run its ``trainer_init``;
    ``client`` overrides ``config["client"]``, and non-sender ranks build none."""
    from wtcore.factory import WeightTransferTrainerFactory

    data = dict(load_config(config) if isinstance(config, (str, Path)) else config)
    backend = data.pop("backend", None)
    if not isinstance(backend, str):
        raise PayloadError(f"config.backend: expected a backend name, got {backend!r}")
    engine_cls = TRAINER_ENGINES.load(backend)
    info_cls = engine_cls.init_info_cls
    client_spec = data.pop("client", None)
    fields = [f.name for f in dataclasses.fields(info_cls) if f.init and f.name != "rank"]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise PayloadError(
            f"config: unknown key(s) {', '.join(map(repr, unknown))} for backend {backend!r}; "
            f"valid keys: backend, client, {', '.join(fields)}"
        )
    init_info = parse_dataclass(info_cls, {**data, "rank": rank}, what="config")
    if client is None and init_info.is_sender:
        if client_spec is None:
            raise PayloadError("config.client: missing; the sender (rank 0) needs a client")
        client = build_client(client_spec)
    return WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)
