"""How the ipc ring cuts a bucket into slot-sized chunks, and the old name of that cut.

``wtcore_ipc.ring.frames`` was renamed ``chunks`` in 0.2.0 (a *frame* is what a streamed
engine sends per bucket, ``wtcore_channel.frames``); the old name forwards to the same
function with a ``DeprecationWarning`` until 0.3, through attribute access and ``import *``.
"""

from __future__ import annotations

import importlib

import pytest

from wtcore_ipc import ring
from wtcore_ipc.ring import chunks

RENAMED = r"wtcore_ipc\.ring\.frames was renamed wtcore_ipc\.ring\.chunks; .* removed in 0\.3"


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


def test_the_old_name_forwards_to_chunks_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=RENAMED) as caught:
        old = ring.frames
    assert len(caught) == 1
    assert old is chunks
    assert "frames" in ring.__all__  # ``import *`` forwards it too, with the warning
    with pytest.warns(DeprecationWarning, match=RENAMED):
        exec("from wtcore_ipc.ring import *", {})


def test_other_missing_names_are_attribute_errors() -> None:
    module = importlib.import_module("wtcore_ipc.ring")
    with pytest.raises(AttributeError, match="'wtcore_ipc.ring' has no attribute 'nope'"):
        module.nope  # noqa: B018
