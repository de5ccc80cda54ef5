"""The JSON record of ``wtcore bench`` (``--json``): its keys, an interface, and the old names.

Top level (:func:`wtcore_bench.runner.run_bench`):

* ``ok``: every receiver verified bit for bit in every round;
* ``host``, ``versions``, ``settings``: where the run was, with what, and its options;
* ``baselines_gbps``: GB/s of every baseline measured next to the engine, by name, in the
  declared order. A baseline (:class:`~wtcore_bench.api.Baseline`) is a *limit* (a ceiling of
  this machine: memcpy, a raw collective), a naive baseline (``file``) or a *peer* (what a
  user would run instead of wtcore);
* ``baseline_labels``: the label of each, for tables and plots;
* ``peers``: the names in ``baselines_gbps`` that are peers;
* ``interleaved``: the names measured in turns with the engine's rounds (``--interleave``);
* ``skipped_baselines``: ``{name: why}`` for those that could not run here;
* ``runs``: one per buffer size (``buffer_size``, ``rounds``, ``median_seconds``,
  ``median_gbps``, ``verified``); each round holds ``baseline_seconds``, the seconds of each
  interleaved baseline's call right before it (empty without ``--interleave``);
* ``best_median_gbps`` and ``ratios``: the best run's median, and it divided by each baseline;
* ``link`` (``--nodes`` only): the link cap, also in ``baselines_gbps`` as ``link_cap``.

**Deprecated** (0.2.0, removed in 0.3): ``limits_gbps`` and ``limit_labels``, 0.1.0's names of
``baselines_gbps`` and ``baseline_labels``, repeat their values.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEPRECATED_KEYS", "with_deprecated_keys"]

#: Deprecated top-level key -> the key whose value it repeats (until 0.3).
DEPRECATED_KEYS = {"limits_gbps": "baselines_gbps", "limit_labels": "baseline_labels"}


def with_deprecated_keys(record: dict[str, Any]) -> dict[str, Any]:
    """(Re)write the deprecated keys of ``record`` as copies of the new ones; returns it."""
    for old, new in DEPRECATED_KEYS.items():
        if new in record:
            record[old] = dict(record[new])
    return record
