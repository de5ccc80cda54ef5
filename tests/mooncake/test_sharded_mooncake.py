"""Sharded rounds on the mooncake engine: trainer ranks pack their buckets into registered
slots step by step and the receivers read them (real transfer engines over TCP, real trainer
processes in a gloo group, real receivers holding TP slices).

Also here: a receiver refuses a forged ``senders`` or ``reads`` update naming the entry before
it reads a byte, and a read the plan or the slots do not allow.
"""

from __future__ import annotations

import pytest

from wtcore.errors import PayloadError
from wtcore.testing.sharded_contract import ShardedContractSuite
from wtcore_mooncake import MooncakeTrainerInitInfo
from wtcore_mooncake.pairs import Read, ReadsUpdate, SendersUpdate

pytest.importorskip("mooncake.engine", reason="Mooncake is not installed")


def mooncake_info(rank: int, buffer_size_bytes: int, receivers: int) -> MooncakeTrainerInitInfo:
    return MooncakeTrainerInitInfo(
        packed_buffer_size_bytes=buffer_size_bytes, timeout_s=60.0, rank=rank
    )


class TestMooncakeSharded(ShardedContractSuite):
    backend = "mooncake"
    trainer_info = staticmethod(mooncake_info)


GOOD = {"endpoint": "127.0.0.1:4000", "slots": [[4096, 1 << 20], [8192, 1 << 20]]}


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ([GOOD], "the plan has 2 trainer ranks, got 1 entries"),
        ({"a": 1}, "the plan has 2 trainer ranks"),
        ([GOOD, {**GOOD, "endpoint": "nohost"}], r"senders\[1\]\.endpoint"),
        ([GOOD, {**GOOD, "endpoint": "h:0"}], r"senders\[1\]\.endpoint"),
        ([GOOD, {**GOOD, "extra": 1}], r"senders\[1\]: expected an object"),
        ([GOOD, {**GOOD, "slots": []}], r"senders\[1\]\.slots: expected 1 to 64"),
        ([GOOD, {**GOOD, "slots": [[0, 10]]}], r"senders\[1\]\.slots\[0\]"),
        ([GOOD, {**GOOD, "slots": [[-1, 10]]}], r"senders\[1\]\.slots\[0\]"),
        ([GOOD, {**GOOD, "slots": [[4096, 0]]}], r"senders\[1\]\.slots\[0\]"),
        ([GOOD, {**GOOD, "slots": [[True, 10]]}], r"senders\[1\]\.slots\[0\]"),
        ([GOOD, {**GOOD, "slots": [[4096, 10, 1]]}], r"senders\[1\]\.slots\[0\]"),
        ([GOOD, {**GOOD, "slots": ["4096"]}], r"senders\[1\]\.slots\[0\]"),
    ],
)
def test_a_forged_senders_update_is_refused_naming_the_entry(entries: list, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        SendersUpdate(entries).checked(2)


@pytest.mark.parametrize(
    ("reads", "match"),
    [
        ("all", r"update_info\.reads: expected a list"),
        ([{"src": 0, "bucket": 0}], r"reads\[0\]: expected an object"),
        ([{"src": 0, "bucket": 0, "slot": -1}], r"reads\[0\]: src, bucket and slot"),
        ([{"src": 0, "bucket": 1.5, "slot": 0}], r"reads\[0\]: src, bucket and slot"),
        ([{"src": True, "bucket": 0, "slot": 0}], r"reads\[0\]: src, bucket and slot"),
    ],
)
def test_a_malformed_step_is_refused_naming_the_read(reads: object, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        ReadsUpdate(reads).checked()  # type: ignore[arg-type]


def test_good_updates_give_the_endpoints_slots_and_reads() -> None:
    assert (
        SendersUpdate([GOOD, GOOD]).checked(2)
        == [("127.0.0.1:4000", [(4096, 1 << 20), (8192, 1 << 20)])] * 2
    )
    assert ReadsUpdate([{"src": 1, "bucket": 2, "slot": 0}]).checked() == [Read(1, 2, 0)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("read", "slot_bytes", "fragment"),
    [
        (
            {"src": 1, "bucket": 0, "slot": 0},
            4096,
            r"reads\[0\]\.src: trainer rank 1 sends nothing",
        ),
        ({"src": 0, "bucket": 5, "slot": 0}, 4096, r"bucket 5 of 1 planned, slot 0 of 1"),
        ({"src": 0, "bucket": 0, "slot": 3}, 4096, r"slot 3 of 1 announced by trainer rank 0"),
        (
            {"src": 0, "bucket": 0, "slot": 0},
            64,
            r"\(2448 bytes\) does not fit slot 0 \(64 bytes\)",
        ),
    ],
)
def test_a_read_the_plan_or_the_slots_do_not_allow_is_refused_before_it_moves(
    read: dict[str, int], slot_bytes: int, fragment: str
) -> None:
    """A real worker, after a real round, in a sharded round's step: a read naming a rank
    that sends it nothing, a bucket it was not planned, a slot not announced, or a slot the
    bucket does not fit is refused, and nothing is written."""
    from tests.mooncake.test_hostile import _state, _synced_worker
    from wtcore.meta import ParamMeta
    from wtcore.sharded.layout import Layout
    from wtcore.sharded.plan import PlannedRound
    from wtcore.testing.contract import assert_state_equal

    worker, trainer, model, init = _synced_worker()
    try:
        metas = [ParamMeta.of(k, t) for k, t in _state().items()]
        whole = {m.name: Layout.whole(m.shape) for m in metas}
        worker.start_weight_update()
        worker.update_weights({"plan": PlannedRound.make(metas, whole, whole).to_wire()})
        slot = [init["slots"][0][0], slot_bytes]
        worker.update_weights({"senders": [{"endpoint": init["endpoint"], "slots": [slot]}]})
        with pytest.raises(PayloadError, match=fragment):
            worker.update_weights({"reads": [read]})
        assert_state_equal(model, _state())  # nothing written
    finally:
        trainer.shutdown()
        worker.shutdown()
