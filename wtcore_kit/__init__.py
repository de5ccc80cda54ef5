"""wtcore's kit: what engines and clients are built from, and the reference pair built on it.

Why a package of its own: ``wtcore`` is the protocol (what crosses between a trainer and its
receivers, and the rules both ends check), and it imports nothing from here. The kit is one
way to implement that protocol: the bucket engines' base classes (:mod:`wtcore_kit.bucketed`),
the one fan-out over receivers (:mod:`wtcore_kit.fanout`), a blocking call with a timeout
(:mod:`wtcore_kit.concurrency`), sharded rounds' pairs as buckets and their schedule
(:mod:`wtcore_kit.sharded`), synthetic models (:mod:`wtcore_kit.synthetic`), and the built-in
``inline`` engine and ``inproc`` client (:mod:`wtcore_kit.inline`, :mod:`wtcore_kit.inproc`),
which are the reference every other engine is tested against. It ships in the ``wtcore``
distribution, so the built-ins are there wherever the core is. Nothing is imported here: import
the module you use.
"""

__all__: list[str] = []
