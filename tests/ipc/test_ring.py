"""How the ipc ring cuts a bucket into slot-sized chunks."""

from __future__ import annotations

import pytest

from wtcore_ipc.ring import chunks


@pytest.mark.parametrize(
    ("nbytes", "slot", "expected"),
    [
        (0, 16, [(0, 0)]),  # an empty bucket is one empty chunk
        (16, 16, [(0, 16)]),
        (40, 16, [(0, 16), (16, 16), (32, 8)]),
        (48, 16, [(0, 16), (16, 16), (32, 16)]),
    ],
)
def test_a_bucket_is_cut_into_slot_sized_chunks(
    nbytes: int, slot: int, expected: list[tuple[int, int]]
) -> None:
    assert chunks(nbytes, slot) == expected
