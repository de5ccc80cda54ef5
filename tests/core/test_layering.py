"""The layers of wtcore and the one direction imports go between them.

protocol <- kit <- engines and clients <- tooling: a module imports its own layer and those to
its left, never one to its right, so the protocol can be read (and changed) without the
transports, and nothing shipped depends on the bench or the tests' tools. Engine and client
plugins see the core only through the plugin API, the list in docs/writing-an-engine.md ("The
plugin API"), which this test reads so the two cannot drift. Every core module is placed in
exactly one layer below: a new module fails the test until it is. Plugins are placed by
package: every ``plugins/*/wtcore_*`` is an engine or client, except the bench, which is
tooling, and ``wtcore_channel``, the streamed engines' kit (a kit of its own distribution). The graph is the one ``test_import_graph.py`` checks (:mod:`graph`).
"""

from __future__ import annotations

import re

from .graph import ROOT, cycles, graph

PROTOCOL = {
    "wtcore": "the public names, re-exported",
    "wtcore._version": "the version, read statically",
    "wtcore.errors": "the error family and its HTTP statuses",
    "wtcore.meta": "tensor metadata on the wire",
    "wtcore.source": "what a trainer sends",
    "wtcore.sink": "what receives it",
    "wtcore.buckets": "the bucket rule, pack, unpack",
    "wtcore.sharded": "sharded rounds, their public names re-exported",
    "wtcore.sharded.layout": "each rank's box of a sharded tensor",
    "wtcore.sharded.plan": "which bytes go from which rank to which",
    "wtcore.sharded.receiver_layout": "how a receiver is sharded, as it reports it",
    "wtcore.sharded.source": "the sources whose ranks each send their own part",
    "wtcore.sharded.round": "one sharded round over many trainer ranks",
    "wtcore.engine": "the worker engine half",
    "wtcore.trainer": "the trainer engine half",
    "wtcore.worker": "the receiver state machine",
    "wtcore.staging": "transactional staging",
    "wtcore.finite": "the finite check",
    "wtcore.ledger": "every announced byte landed",
    "wtcore.verify": "verify=True",
    "wtcore.digest": "the digests verify compares",
    "wtcore.client": "the client protocols",
    "wtcore.rounds": "who owns a round",
    "wtcore.factory": "names to engine pairs",
    "wtcore.registry": "the registries",
    "wtcore.config": "config files",
    "wtcore.hooks": "calling the observers",
    "wtcore.hookspecs": "the hooks a plugin implements",
    "wtcore.defaults": "the one default timeout",
    "wtcore.stats": "what one send_weights did",
    "wtcore.parse": "untrusted input to typed values",
    "wtcore.units": "byte sizes",
    "wtcore._deprecated": "forwarding a 0.1.0 module path with a warning, until 0.3",
    **dict.fromkeys(
        [f"wtcore.{m}" for m in ("bench", "concurrency", "fanout", "guards", "inproc", "kit")]
        + [f"wtcore.{m}" for m in ("local", "net", "procs", "synthetic")],
        "a 0.1.0 module path, forwarded until 0.3",
    ),
}
KIT = {
    "wtcore_kit": "the kit's package (imports nothing)",
    "wtcore_kit.bucketed": "what every bucket engine shares",
    "wtcore_kit.concurrency": "a blocking call with a timeout",
    "wtcore_kit.fanout": "the one fan-out",
    "wtcore_kit.sharded": "the kit's sharded part (imports nothing)",
    "wtcore_kit.sharded.pairs": "a plan's pairs as buckets, packed and assembled",
    "wtcore_kit.sharded.schedule": "a round's pairs in steps every rank computes alike",
    "wtcore_kit.synthetic": "synthetic models",
}
CORE_ENGINES_AND_CLIENTS = {
    "wtcore_kit.inline": "the built-in inline engine",
    "wtcore_kit.inproc": "the in-process client",
}
CORE_TOOLING = {
    "wtcore.cli": "the wtcore command",
    "wtcore.__main__": "python -m wtcore",
    "wtcore.inventory": "wtcore plugins",
    "wtcore.testing": "the contract suites and test helpers (and every wtcore.testing.*)",
}
#: The core distribution's packages: the protocol (``wtcore``) and its kit (``wtcore_kit``),
#: every module placed in a table above.
CORE_PACKAGES = {"wtcore", "wtcore_kit"}
TOOLING_PLUGINS = {"wtcore_bench"}
#: Kits of their own distribution: engines build on them, they build on the plugin API only.
KIT_PLUGINS = {"wtcore_channel"}

# Imports across layers still to be taken apart, each listed exactly. None today: the last one
# (the worker wiring the delta receiver into its sink chain) went when delta rounds became the
# wtcore-delta distribution, whose two halves the core finds by name (a round policy and a
# receiver layer); test_the_circles_of_the_issue_fail_when_put_back puts both edges back.
KNOWN_BREAKS: set[tuple[str, str]] = set()

PROTOCOL_L, KIT_L, ENGINES_L, TOOLING_L = "protocol", "kit", "engines and clients", "tooling"
RANK = {PROTOCOL_L: 0, KIT_L: 1, ENGINES_L: 2, TOOLING_L: 3}


def plugin_api() -> set[str]:
    """The core modules listed under "## The plugin API" in docs/writing-an-engine.md."""
    text = (ROOT / "docs" / "writing-an-engine.md").read_text()
    section = text.split("\n## The plugin API\n", 1)[1].split("\n## ", 1)[0]
    bullets = [line for line in section.splitlines() if line.startswith("- ")]
    return {m for line in bullets for m in re.findall(r"`(wtcore(?:\.\w+)+)`", line.split(":")[0])}


def layer_of(module: str) -> str | None:
    """The layer a module is placed in, or None if it is not placed."""
    top = module.split(".")[0]
    for layer, table in (
        (PROTOCOL_L, PROTOCOL),
        (KIT_L, KIT),
        (ENGINES_L, CORE_ENGINES_AND_CLIENTS),
        (TOOLING_L, CORE_TOOLING),
    ):
        if module in table:
            return layer
    if top in CORE_PACKAGES:
        is_testing = module == "wtcore.testing" or module.startswith("wtcore.testing.")
        return TOOLING_L if is_testing else None
    if top in KIT_PLUGINS:
        return KIT_L
    return TOOLING_L if top in TOOLING_PLUGINS else ENGINES_L


def layer_breaks(g: dict[str, set[str]], api: set[str]) -> list[str]:
    """Every import against the layers, one line each naming importer and imported."""
    out = []
    for m, deps in sorted(g.items()):
        lm = layer_of(m)
        top = m.split(".")[0]
        for d in sorted(deps):
            ld = layer_of(d)
            if lm is None or ld is None or (m, d) in KNOWN_BREAKS:
                continue  # unplaced modules are reported by their own test
            if RANK[ld] > RANK[lm]:
                out.append(f"{m} ({lm}) imports {d} ({ld})")
            elif lm == TOOLING_L and ld == TOOLING_L and d.split(".")[0] in TOOLING_PLUGINS:
                if top in CORE_PACKAGES:
                    out.append(f"{m} ({lm}, core) imports {d} (the bench)")
            elif lm in (KIT_L, ENGINES_L) and top != "wtcore" and d.split(".")[0] == "wtcore":
                if d not in api:
                    out.append(f"{m} ({lm}) imports {d}, not in the plugin API")
            elif lm == ENGINES_L and ld == ENGINES_L and d.split(".")[0] != top:
                out.append(f"{m} ({lm}) imports {d}, another engine or client")
    return out


def test_every_core_module_is_in_exactly_one_layer() -> None:
    tables = [PROTOCOL, KIT, CORE_ENGINES_AND_CLIENTS, CORE_TOOLING]
    placed = [m for t in tables for m in t]
    assert sorted(m for m in set(placed) if placed.count(m) > 1) == []
    unplaced = sorted(m for m in graph() if layer_of(m) is None)
    assert unplaced == [], "place these modules in a layer (tests/core/test_layering.py)"
    stale = sorted(m for m in placed if m not in graph())
    assert stale == [], "these placed modules no longer exist"


def test_the_plugin_api_is_a_list_of_real_core_modules() -> None:
    api = plugin_api()
    assert {"wtcore.errors", "wtcore.sharded.plan", "wtcore.parse", "wtcore.sharded.round"} <= api
    g = graph()
    assert sorted(m for m in api if m not in g) == []
    # the plugin API is protocol and kit only: nothing a plugin sees is a tool or another engine
    assert sorted(m for m in api if layer_of(m) not in (PROTOCOL_L, KIT_L)) == []


def _documented_layers() -> dict[str, str]:
    """``{core module: layer}`` from the table under "Where things live" in architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Where things live\n", 1)[1].split("\n## ", 1)[0]
    out = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) == 3 and cells[0] in RANK:
            for m in re.findall(r"`(wtcore\w*(?:\.\w+)*)`", cells[1]):
                out[m] = cells[0]
    return out


def test_the_architecture_doc_lists_the_same_layers() -> None:
    documented = _documented_layers()
    wrong = sorted(
        f"{m}: doc {d}, test {layer_of(m)}" for m, d in documented.items() if d != layer_of(m)
    )
    assert wrong == []
    for layer, table in ((PROTOCOL_L, PROTOCOL), (KIT_L, KIT)):
        assert sorted(m for m, d in documented.items() if d == layer) == sorted(table), layer


def test_imports_follow_the_layers() -> None:
    breaks = layer_breaks(graph(), plugin_api())
    assert breaks == [], "imports against the layers:\n" + "\n".join(breaks)


def test_every_known_break_is_still_there() -> None:
    """An entry outliving its import would hide it coming back: delete it instead."""
    g = graph()
    assert sorted(b for b in KNOWN_BREAKS if b[1] not in g.get(b[0], set())) == []


def test_a_new_plugin_is_an_engine_and_the_bench_is_tooling() -> None:
    assert layer_of("wtcore_quic.stream") == ENGINES_L
    assert layer_of("wtcore_bench.api") == TOOLING_L
    assert layer_of("wtcore_channel.sender") == KIT_L


def test_engines_build_on_the_channel_kit_never_the_reverse() -> None:
    """nccl and tcp import the streamed kit; the kit importing an engine, or a core module
    outside the plugin API, is a break."""
    g = graph()
    assert "wtcore_channel" in {d.split(".")[0] for d in g["wtcore_tcp.trainer"]}
    assert "wtcore_channel" in {d.split(".")[0] for d in g["wtcore_nccl.trainer"]}
    assert layer_breaks(g, plugin_api()) == []
    back = _with(g, ("wtcore_channel.sender", "wtcore_nccl.group"))
    assert any("wtcore_channel.sender" in b for b in layer_breaks(back, plugin_api()))
    private = _with(g, ("wtcore_channel.sender", "wtcore.staging"))
    assert any("not in the plugin API" in b for b in layer_breaks(private, plugin_api()))


def _with(g: dict[str, set[str]], *edges: tuple[str, str]) -> dict[str, set[str]]:
    out = {m: set(ds) for m, ds in g.items()}
    for a, b in edges:
        out.setdefault(a, set()).add(b)
        out.setdefault(b, set())
    return out


def test_the_circles_of_the_issue_fail_when_put_back() -> None:
    """Each of the issue's four circles, put back into today's graph, is caught."""
    g, api = graph(), plugin_api()
    # the protocol's trainer importing the bench's api (which imports the trainer back)
    bench = _with(g, ("wtcore.trainer", "wtcore_bench.api"), ("wtcore_bench.api", "wtcore.trainer"))
    assert ["wtcore.trainer", "wtcore_bench.api"] in [
        [m for m in c if m in ("wtcore.trainer", "wtcore_bench.api")] for c in cycles(bench)
    ]
    assert "wtcore.trainer (protocol) imports wtcore_bench.api (tooling)" in layer_breaks(
        bench, api
    )
    # the baselines and the runner importing each other
    runner = _with(
        g,
        ("wtcore_bench.baselines", "wtcore_bench.runner"),
        ("wtcore_bench.runner", "wtcore_bench.baselines"),
    )
    assert ["wtcore_bench.baselines", "wtcore_bench.runner"] in cycles(runner)
    # the http server's `__main__` block importing the commands, which import the server
    http = _with(g, ("wtcore_http_client.server", "wtcore_http_client.commands"))
    assert ["wtcore_http_client.commands", "wtcore_http_client.server"] in cycles(http)
    # the base trainer importing the delta trainer again (which imports the trainer)
    delta = _with(g, ("wtcore.trainer", "wtcore_delta.trainer"))
    assert ["wtcore.trainer", "wtcore_delta.trainer"] in [
        [m for m in c if m in ("wtcore.trainer", "wtcore_delta.trainer")] for c in cycles(delta)
    ]
    assert (
        "wtcore.trainer (protocol) imports wtcore_delta.trainer (engines and clients)"
        in layer_breaks(delta, api)
    )
    # the worker wiring the delta receiver into its chain by import again
    receiver = _with(g, ("wtcore.worker", "wtcore_delta.receiver"))
    assert (
        "wtcore.worker (protocol) imports wtcore_delta.receiver (engines and clients)"
        in layer_breaks(receiver, api)
    )


def test_each_rule_names_the_offending_import() -> None:
    g, api = graph(), plugin_api()
    cases = {
        (
            "wtcore.meta",
            "wtcore_kit.sharded.pairs",
        ): "wtcore.meta (protocol) imports wtcore_kit.sharded.pairs (kit)",
        ("wtcore_kit.bucketed", "wtcore_kit.inline"): (
            "wtcore_kit.bucketed (kit) imports wtcore_kit.inline (engines and clients)"
        ),
        ("wtcore_kit.fanout", "wtcore.staging"): (
            "wtcore_kit.fanout (kit) imports wtcore.staging, not in the plugin API"
        ),
        ("wtcore_nccl", "wtcore.testing.net"): (
            "wtcore_nccl (engines and clients) imports wtcore.testing.net (tooling)"
        ),
        (
            "wtcore_nccl",
            "wtcore.cli",
        ): "wtcore_nccl (engines and clients) imports wtcore.cli (tooling)",
        ("wtcore_nccl", "wtcore.staging"): (
            "wtcore_nccl (engines and clients) imports wtcore.staging, not in the plugin API"
        ),
        ("wtcore_vllm", "wtcore_nccl.config"): (
            "wtcore_vllm (engines and clients) imports wtcore_nccl.config, another engine or client"
        ),
        ("wtcore.testing.net", "wtcore_bench.netns"): (
            "wtcore.testing.net (tooling, core) imports wtcore_bench.netns (the bench)"
        ),
    }
    for edge, message in cases.items():
        assert message in layer_breaks(_with(g, edge), api), edge
    # the bench, tooling, may import the tests' tools, any engine and any core module
    assert layer_breaks(_with(g, ("wtcore_bench.api", "wtcore.staging")), api) == []
