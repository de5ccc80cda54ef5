"""The JSON record of ``wtcore bench``: what its keys hold, and the old names kept a release.

Scripts read this record (``--json``), so its keys are an interface; this module is where they
are described, and where the deprecated names are written. Top level
(:func:`wtcore_bench.runner.run_bench`):

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

**Deprecated** (0.2.0, removed in 0.3): ``limits_gbps`` and ``limit_labels`` are 0.1.0's
names of ``baselines_gbps`` and ``baseline_labels``, from when the whole set was called limits
although a limit is one kind of baseline. The record still carries them, with the same values,
so a script that reads them keeps working; read the new names.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEPRECATED_KEYS", "with_deprecated_keys"]

#: Deprecated top-level key -> the key whose value it repeats (until 0.3).
DEPRECATED_KEYS = {"limits_gbps": "baselines_gbps", "limit_labels": "baseline_labels"}


def with_deprecated_keys(record: dict[str, Any]) -> dict[str, Any]:
    """Write (or rewrite, after a change to the new keys) the deprecated keys of ``record``
    as copies of the new ones; returns ``record``."""
    for old, new in DEPRECATED_KEYS.items():
        if new in record:
            record[old] = dict(record[new])
    return record
