"""What a vLLM server's workers report through ``/collective_rpc`` is checked before a trainer
plans with it (:func:`wtcore_http_client.vllm_workers.worker_reports`); the round trip against
a real vLLM server at TP=2 is ``tests/vllm/test_vllm_sharded.py``."""

from __future__ import annotations

import pytest

from wtcore.errors import PayloadError
from wtcore_http_client.vllm_workers import worker_reports

pytestmark = pytest.mark.processes


def _w(rank: int, **more: object) -> dict[str, object]:
    return {"rank": rank, "world_size": 2, "layout": None, **more}


def test_reports_come_back_in_rank_order() -> None:
    got = worker_reports(
        {"results": [_w(1), _w(0, round_bytes={"planned": 1, "landed": 1})]}, where="x"
    )
    assert [r["rank"] for r in got] == [0, 1]


@pytest.mark.parametrize(
    ("answer", "field"),
    [
        (None, "x.results"),
        ({"results": []}, "x.results"),
        ({"results": ["no"]}, "x.results[0]"),
        ({"results": [{"rank": 0}]}, "x.results[0]"),
        ({"results": [_w(True)]}, "x.results[0]"),  # type: ignore[arg-type]
        ({"results": [_w(0, extra=1)]}, "x.results[0]"),
        ({"results": [_w(0), _w(2)]}, "x.results"),
    ],
)
def test_a_bad_answer_is_refused_naming_the_field(answer: object, field: str) -> None:
    with pytest.raises(PayloadError, match=f"^{field.replace('[', '.').replace(']', '.')}"):
        worker_reports(answer, where="x")
