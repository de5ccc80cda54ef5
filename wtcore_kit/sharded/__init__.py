"""The kit's part of sharded rounds: a plan's (sender, receiver) pairs as buckets, packed and
assembled (:mod:`wtcore_kit.sharded.pairs`), and the steps every rank moves them in
(:mod:`wtcore_kit.sharded.schedule`). Nothing is imported here: import the module you use.
"""

__all__: list[str] = []
