"""The JSON record of ``wtcore bench`` (``--json``): its keys, an interface, and the old names.

* ``ok``: every receiver verified bit for bit in every round;
* ``host``, ``versions``, ``settings``: where the run was, with what, and its options;
* ``baselines_gbps``: GB/s of every baseline (a limit, a naive baseline or a peer), by name, in
  the declared order; ``baseline_labels``: their labels; ``peers``: which are peers;
* ``interleaved``: the names measured in turns with the rounds; ``skipped_baselines``: why not;
* ``runs``: one per buffer size (``buffer_size``, ``rounds``, ``median_seconds``,
  ``median_gbps``, ``verified``); each round holds ``baseline_seconds`` (``--interleave``);
* ``best_median_gbps`` and ``ratios``: the best run's median, and it over each baseline;
* ``link`` (``--nodes`` only): the link cap, also in ``baselines_gbps`` as ``link_cap``.

Deprecated (0.2.0, removed in 0.3): ``limits_gbps`` and ``limit_labels`` repeat the new keys.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEPRECATED_KEYS", "with_deprecated_keys"]

#: Deprecated top-level key -> the key whose value it repeats (until 0.3).
DEPRECATED_KEYS = {"limits_gbps": "baselines_gbps", "limit_labels": "baseline_labels"}


def with_deprecated_keys(record: dict[str, Any]) -> dict[str, Any]:
    for old, new in DEPRECATED_KEYS.items():
        if new in record:
            record[old] = dict(record[new])
    return record
