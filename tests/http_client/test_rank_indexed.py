"""Rank-indexed ``update_info``: each receiver gets its own ranks' entries and nothing else.

A per-rank payload names memory, peers or shards that concern one rank only; sending the
whole list to every receiver (as vLLM's API server does to its workers) leaks them and lets a
receiver act on another rank's entry. wtcore's clients cut the list by receiver
(:func:`wtcore_kit.fanout.split_by_receiver`). Tested over a real HTTP server per receiver and in
process, with the inline engine, whose entries carry the weights themselves: each receiver
must end up holding exactly its own entry's tensor.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from wtcore import ModuleSink, WeightSyncWorker
from wtcore.digest import digest_named
from wtcore.errors import PayloadError
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_http_client.routes import ReceiverRoutes
from wtcore_http_client.server import ReceiverHTTPServer
from wtcore_kit.inproc import InProcessClient
from wtcore_kit.synthetic import build_module

pytestmark = pytest.mark.processes


class RecordingWorker(WeightSyncWorker):
    """A real worker that also keeps every ``update_info`` it was given, as given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[Any] = []

    def update_weights(self, update_info: Any, **kwargs: Any) -> None:
        self.seen.append(update_info)
        super().update_weights(update_info, **kwargs)


def entry(value: float) -> dict[str, Any]:
    t = torch.full((4,), value)
    data = base64.b64encode(t.numpy().tobytes()).decode()
    return {"names": ["w"], "dtype_names": ["float32"], "shapes": [[4]], "data": data}


def workers(n: int) -> list[RecordingWorker]:
    return [
        RecordingWorker(
            "inline", ModuleSink(build_module({"w": torch.zeros(4)})), rank=i, world_size=n
        )
        for i in range(n)
    ]


@contextlib.contextmanager
def http_client(fleet: list[RecordingWorker]) -> Iterator[HTTPWeightSyncClient]:
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(ReceiverHTTPServer(ReceiverRoutes(w))).url for w in fleet]
        yield stack.enter_context(HTTPWeightSyncClient(urls, timeout_s=60))


@contextlib.contextmanager
def in_process(fleet: list[RecordingWorker]) -> Iterator[InProcessClient]:
    yield InProcessClient(fleet, timeout_s=60)


CLIENTS = {"http": http_client, "in_process": in_process}


@pytest.mark.parametrize("kind", sorted(CLIENTS))
def test_each_receiver_gets_only_its_own_entry(kind: str) -> None:
    fleet = workers(3)
    entries = [entry(10.0 + i) for i in range(3)]
    with CLIENTS[kind](fleet) as client:
        client.init_weight_transfer_engine({"packed_buffer_size_bytes": 1 << 10})
        client.start_weight_update()
        client.update_weights(entries)
        client.finish_weight_update("v1")
        sums = client.checksums()
    for i, w in enumerate(fleet):
        assert w.seen == [entries[i]]  # its entry alone, not the list
        assert sums[i] == digest_named([("w", torch.full((4,), 10.0 + i))])
        assert w.weight_info()["consistent"] is True


def test_a_receiver_hosting_several_ranks_gets_its_block_in_rank_order() -> None:
    """A vLLM server with TP=2 indexes its sub-list by local rank: receiver i gets [2i, 2i+2)."""
    fleet = workers(2)
    for w in fleet:
        w.world_size = 2  # each "server" hosts two ranks and indexes its block by .rank
    entries = [entry(float(j)) for j in range(4)]
    with http_client(fleet) as client:
        client.init_weight_transfer_engine({"packed_buffer_size_bytes": 1 << 10})
        client.start_weight_update()
        client.update_weights(entries)
        client.finish_weight_update("v1")
        sums = client.checksums()
    assert fleet[0].seen == [entries[0:2]] and fleet[1].seen == [entries[2:4]]
    # worker i is rank i of its two-rank block: it loaded entry 2*0+0 and 2*1+1
    assert sums == [digest_named([("w", torch.full((4,), v))]) for v in (0.0, 3.0)]


@pytest.mark.parametrize(
    ("entries", "fragment"),
    [
        ([entry(1.0), entry(2.0)], "a list of 2 entries does not split evenly over 3 receivers"),
        ([], "a list of 0 entries"),
        ([entry(1.0), "x", entry(2.0)], r"update_info\[1\]: expected a JSON object, got str"),
    ],
)
def test_a_list_that_does_not_fit_the_receivers_is_refused_before_anything_is_sent(
    entries: list[Any], fragment: str
) -> None:
    fleet = workers(3)
    with http_client(fleet) as client:
        client.init_weight_transfer_engine({"packed_buffer_size_bytes": 1 << 10})
        client.start_weight_update()
        with pytest.raises(PayloadError, match=fragment):
            client.update_weights(entries)
        client.abort_weight_update()
    assert all(w.seen == [] for w in fleet)
