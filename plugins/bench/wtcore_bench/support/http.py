"""``wtcore bench --client http``: the bench's receivers as ``wtcore serve`` processes."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, ClassVar

from wtcore.errors import PayloadError
from wtcore_bench.api import ClientBench

__all__ = ["CLIENT", "HTTPFleet"]

_FLAGS = {"transactional": "--transactional", "reject_nonfinite": "--reject-nonfinite"}


class HTTPFleet:
    """``count`` ``wtcore serve`` processes and their client; under ``--nodes`` each runs in its
    node, with the run's API key."""

    places_on_nodes: ClassVar[bool] = True

    def __init__(
        self,
        client_cls: type[Any],
        backend: str,
        count: int,
        model: Any,
        *,
        timeout_s: float,
        options: Mapping[str, Any],
    ) -> None:
        from wtcore_bench.nodes import placement
        from wtcore_bench.serve import ServeProcess, launch_serve

        where = placement()
        unknown = sorted(set(options) - set(_FLAGS))
        if unknown:
            raise PayloadError(f"options {unknown} are not supported by wtcore serve")
        flags = [_FLAGS[k] for k, v in options.items() if v]
        self.servers: list[ServeProcess] = []
        try:
            for rank in range(count):
                node = where.node_for(rank) if where is not None else None
                remote = []
                if node is not None and where is not None:
                    remote = ["--host", node.address, "--port", "0", "--api-key", where.api_key]
                self.servers.append(
                    launch_serve(
                        [
                            *remote,
                            "--backend", backend,
                            "--rank", str(rank),
                            "--world-size", str(count),
                            "--size", str(model.size_bytes),
                            "--tensors", str(model.num_tensors),
                            "--dtype", model.dtype,
                            "--seed", str(model.seed),
                            "--device", model.device,
                            "--max-body", "1GiB",
                            *flags,
                        ],
                        prefix=node.argv([]) if node is not None else (),
                    )
                )  # fmt: skip
            key = {"api_key": where.api_key} if where is not None else {}
            self.client = client_cls([s.url for s in self.servers], timeout_s=timeout_s, **key)
        except BaseException:
            self.close()
            raise

    def pids(self) -> list[int]:
        return [s.pid for s in self.servers]

    def close(self) -> None:
        with contextlib.suppress(AttributeError):
            self.client.close()
        for server in self.servers:
            server.stop(timeout_s=10)


#: ``client.http`` in ``wtcore.bench``.
CLIENT = ClientBench(HTTPFleet)
