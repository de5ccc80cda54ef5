"""The bench record's deprecated keys (until 0.3) repeat the new ones, and follow their changes.

``limits_gbps`` and ``limit_labels`` (0.1.0) were renamed ``baselines_gbps`` and
``baseline_labels`` in 0.2.0 (a limit is one kind of baseline). A script that reads the old keys
keeps working for one release; the end-to-end run checks them in ``test_bench.py``.
"""

from __future__ import annotations

import json
from typing import Any

from wtcore_bench.record import DEPRECATED_KEYS, with_deprecated_keys


def _record() -> dict[str, Any]:
    return {
        "baselines_gbps": {"memcpy": 12.5, "file": 0.95},
        "baseline_labels": {"memcpy": "single-thread memcpy", "file": "torch.save + load"},
        "runs": [{"rounds": [{"baseline_seconds": {"memcpy": 0.01}}, {"baseline_seconds": {}}]}],
    }


def test_the_old_keys_repeat_the_new_ones_through_json() -> None:
    record = json.loads(json.dumps(with_deprecated_keys(_record())))
    assert record["limits_gbps"] == record["baselines_gbps"] == {"memcpy": 12.5, "file": 0.95}
    assert record["limit_labels"] == record["baseline_labels"]
    assert "limit_seconds" not in record["runs"][0]["rounds"][0]  # never in a release
    assert set(DEPRECATED_KEYS.values()) == {"baselines_gbps", "baseline_labels"}


def test_rewriting_after_a_change_to_the_new_keys_updates_the_old() -> None:
    """What ``--nodes`` does: it adds the link cap to the new keys, then rewrites the old."""
    record = with_deprecated_keys(_record())
    record["baselines_gbps"]["link_cap"] = 1.25
    assert "link_cap" not in record["limits_gbps"]  # a copy, not the same dict
    with_deprecated_keys(record)
    assert record["limits_gbps"] == record["baselines_gbps"]


def test_a_record_without_the_new_keys_is_left_alone() -> None:
    assert with_deprecated_keys({"ok": True}) == {"ok": True}
