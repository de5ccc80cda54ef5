"""``wtcore serve``: host a model behind the receiver routes, contributed through the CLI hook.

The server (:mod:`wtcore_http_client.server`) only moves bytes and never imports this module;
this one builds the worker and the model and hands them to it. It is loaded by ``wtcore``'s
plugin manager on every ``wtcore`` command, so it imports nothing heavy at module level: torch
and the server are imported when ``serve`` runs.

The first line on stdout is machine-readable, for scripts and tests::

    wtcore serve: listening on http://127.0.0.1:41234

SIGTERM and SIGINT stop the server, shut the worker's engine down and exit with status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from wtcore.errors import PayloadError
from wtcore.hookspecs import hookimpl
from wtcore.parse import size_argument

if TYPE_CHECKING:
    import torch

    from wtcore.sharded.receiver_layout import TPLayout

__all__ = [
    "LISTENING",
    "TP_PRESETS",
    "add_serve_arguments",
    "build_model",
    "main",
    "run_serve",
    "serve_and_exit",
    "tp_rules_argument",
    "wtcore_add_commands",
]

#: The prefix of the first stdout line; the URL follows it.
LISTENING = "wtcore serve: listening on "
_STOP_TIMEOUT_S = 10.0
#: ``--tp-rules`` presets. ``llama``: how vLLM splits a Llama-family checkpoint's names (Qwen2
#: and Mistral use them too, and so does :func:`wtcore_kit.synthetic.synthetic_state`).
TP_PRESETS: dict[str, tuple[tuple[str, str], ...]] = {
    "llama": (
        ("*.q_proj.weight", "column"),
        ("*.k_proj.weight", "column"),
        ("*.v_proj.weight", "column"),
        ("*.gate_proj.weight", "column"),
        ("*.up_proj.weight", "column"),
        ("*.o_proj.weight", "row"),
        ("*.down_proj.weight", "row"),
        ("model.embed_tokens.weight", "vocab"),
        ("lm_head.weight", "vocab"),
    )
}


@hookimpl
def wtcore_add_commands(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``wtcore serve`` and ``wtcore check``."""
    from wtcore_http_client.check import add_check_arguments

    p = subparsers.add_parser(
        "serve",
        help="run an HTTP weight receiver (the vLLM RL routes) hosting a model",
        description="Run an HTTP weight receiver hosting a synthetic or safetensors model.",
    )
    add_serve_arguments(p)
    add_check_arguments(
        subparsers.add_parser(
            "check",
            help="checksum, reset, sync, compare: does a sync write every weight?",
            description="Checksum each receiver, zero its weights, run the sync command, "
            "compare; exit 1 on any mismatch.",
        )
    )


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``wtcore serve`` (shared with ``python -m wtcore_http_client.server``)."""
    p.add_argument("--backend", default="inline", help="worker engine name (default: local)")
    p.add_argument(
        "--backend-options",
        default="{}",
        metavar="JSON",
        help="worker-local engine options as a JSON object (default: {})",
    )
    p.add_argument("--rank", type=int, default=0, help="this worker's rank (default 0)")
    p.add_argument("--world-size", type=int, default=1, help="number of workers (default 1)")
    p.add_argument("--device", default="cpu", help="device of the hosted model (default cpu)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one")
    p.add_argument(
        "--api-key",
        default=os.environ.get("WTCORE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $WTCORE_API_KEY); "
        "needed to bind a non-loopback address",
    )
    p.add_argument(
        "--max-body", type=size_argument, default=None, help="request body limit (default 64MiB)"
    )
    limits = p.add_argument_group("limits per peer (docs/http.md)")
    limits.add_argument(
        "--max-connections", type=int, default=64, help="connections served at once (default 64)"
    )
    limits.add_argument(
        "--idle-timeout", type=float, default=60.0, help="seconds to the next request (default 60)"
    )
    limits.add_argument(
        "--header-timeout", type=float, default=10.0, help="seconds for the headers (default 10)"
    )
    limits.add_argument(
        "--body-timeout", type=float, default=120.0, help="seconds for a body (default 120)"
    )
    p.add_argument(
        "--transactional",
        action="store_true",
        help="stage each round and apply it only at finish (one extra copy of the model)",
    )
    p.add_argument(
        "--reject-nonfinite", action="store_true", help="refuse batches holding NaN or Inf"
    )
    p.add_argument(
        "--require-round-id",
        action="store_true",
        help="refuse (409) an init, start, update or finish without a round id: only wtcore "
        "clients, never a vLLM-style trainer's unowned round (docs/reliability.md)",
    )
    p.add_argument(
        "--round-timeout-s",
        type=float,
        default=None,
        help="abandon an open round after this many seconds without a call "
        "(default: the core's DEFAULT_ROUND_TIMEOUT_S; see docs/protocol.md)",
    )
    tp = p.add_argument_group("a TP slice: host only this receiver's part of each tensor")
    tp.add_argument(
        "--tp-rank", type=int, metavar="R", help="this receiver's TP rank (with --tp-size)"
    )
    tp.add_argument(
        "--tp-size", type=int, metavar="N", help="the TP group's size; turns the slice on"
    )
    tp.add_argument(
        "--tp-rules",
        type=tp_rules_argument,
        metavar="RULES",
        help="comma-separated PATTERN=KIND rules (KIND: column, row, vocab, replicated) and "
        "presets (llama), the first match winning (default: llama)",
    )
    model = p.add_argument_group("model (synthetic unless --safetensors is given)")
    model.add_argument("--safetensors", metavar="PATH", help="load the model from this file")
    model.add_argument(
        "--size", type=size_argument, default=size_argument("16MiB"), help="synthetic size"
    )
    model.add_argument("--tensors", type=int, default=30, help="synthetic tensor count")
    model.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    model.add_argument("--seed", type=int, default=0, help="synthetic weights' seed")
    p.set_defaults(func=serve_and_exit)


def tp_rules_argument(text: str) -> tuple[tuple[str, str], ...]:
    """``--tp-rules``: rules and presets in order, so an override goes before its preset."""
    from wtcore.sharded.receiver_layout import KINDS

    rules: list[tuple[str, str]] = []
    for item in text.split(","):
        pattern, _, kind = item.rpartition("=")
        if item in TP_PRESETS:
            rules += TP_PRESETS[item]
        elif pattern and kind in KINDS:
            rules.append((pattern, kind))
        else:
            raise argparse.ArgumentTypeError(
                f"{item!r:.80} is neither a preset ({', '.join(TP_PRESETS)}) nor PATTERN=KIND "
                f"with KIND one of {', '.join(KINDS)}"
            )
    return tuple(rules)


def _tp_layout(args: argparse.Namespace) -> TPLayout | None:
    """The ``--tp-*`` options' layout (``None``: a whole replica); errors name the option."""
    from wtcore.sharded.receiver_layout import TPLayout

    if args.tp_size is None:
        if args.tp_rank is not None or args.tp_rules is not None:
            raise PayloadError("--tp-rank and --tp-rules need --tp-size")
        return None
    try:
        return TPLayout(args.tp_rank, args.tp_size, args.tp_rules or TP_PRESETS["llama"])
    except PayloadError as e:  # TPLayout's own checks; "layout.tp_rank" is --tp-rank here
        msg = str(e).replace("layout.tp_", "--tp-").replace("layout.", "--tp-")
        raise PayloadError(msg) from None


def build_model(args: argparse.Namespace, layout: TPLayout | None = None) -> torch.nn.Module:
    """The hosted model: from ``--safetensors``, or synthetic of ``--size`` and ``--seed``;
    with a ``layout``, only this receiver's slice of each tensor, as a vLLM TP worker keeps
    its slice of the checkpoint (so the trainer sends it only that slice)."""
    from wtcore_kit.synthetic import build_module, synthetic_state

    if args.safetensors:
        from wtcore_http_client.safetensors import load_safetensors

        state = load_safetensors(args.safetensors)
    else:
        state = synthetic_state(args.size, args.tensors, args.dtype, args.seed)
    if layout is not None:
        if all(layout.kind(n) == "replicated" for n in state):  # surely a typo in the rules
            names = ", ".join(list(state)[:3])
            raise PayloadError(f"--tp-rules: no rule splits a tensor of the model ({names}, ...)")
        state = {
            n: layout.local(n, t).contiguous()
            for n, t in state.items()
            if layout.kind(n) != "absent"
        }
    return build_module(state).to(args.device)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; 0 on a clean stop, 2 on bad options."""
    from wtcore.registry import ENGINES
    from wtcore.sink import ModuleSink
    from wtcore.worker import WeightSyncWorker
    from wtcore_http_client.routes import DEFAULT_MAX_BODY_BYTES, ReceiverRoutes
    from wtcore_http_client.server import ReceiverHTTPServer, ServerLimits, check_bind

    try:
        if args.api_key == "":
            raise PayloadError(
                "--api-key (or WTCORE_API_KEY) is empty: set a key, or unset it to run "
                "without authentication on a loopback address"
            )
        options = json.loads(args.backend_options)
        if not isinstance(options, dict):
            raise PayloadError("--backend-options: expected a JSON object")
        check_bind(args.host, bool(args.api_key))
        limits = ServerLimits(
            max_connections=args.max_connections,
            idle_timeout_s=args.idle_timeout,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
        )
        layout = _tp_layout(args)
        model = build_model(args, layout)
    except ValueError as e:
        print(f"wtcore serve: error: {e}", file=sys.stderr)
        return 2
    args.backend = ENGINES.resolve(args.backend)  # a renamed engine's old name: said once
    worker = WeightSyncWorker(
        {"backend": args.backend, **options},
        ModuleSink(model, layout=layout),
        device=args.device,
        rank=args.rank,
        world_size=args.world_size,
        transactional=args.transactional,
        reject_nonfinite=args.reject_nonfinite,
        require_round_id=args.require_round_id,
        **({} if args.round_timeout_s is None else {"round_timeout_s": args.round_timeout_s}),
    )
    routes = ReceiverRoutes(
        worker, api_key=args.api_key, max_body_bytes=args.max_body or DEFAULT_MAX_BODY_BYTES
    )
    server = ReceiverHTTPServer(routes, host=args.host, port=args.port, limits=limits)

    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        print(f"{LISTENING}{server.url}", flush=True)
        tp = f" tp={layout.tp_rank}/{layout.tp_size}" if layout else ""
        print(
            f"wtcore serve: backend={args.backend} rank={args.rank}/{args.world_size}{tp} "
            f"tensors={sum(1 for _ in model.parameters())} auth={'on' if args.api_key else 'off'}",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        server.stop(_STOP_TIMEOUT_S)
        _shutdown_worker(worker)
    print("wtcore serve: stopped", flush=True)
    return 0


def _shutdown_worker(worker: Any) -> None:
    """Release the engine, but never hang the exit on a data plane stuck on a dead peer."""
    from wtcore_kit.concurrency import BackgroundCall

    call = BackgroundCall(worker.shutdown, name="worker-shutdown")
    if not call.wait(_STOP_TIMEOUT_S):
        print("wtcore serve: engine shutdown timed out; exiting anyway", file=sys.stderr)
    elif call.error is not None:
        print(f"wtcore serve: engine shutdown failed: {call.error}", file=sys.stderr)


def serve_and_exit(args: argparse.Namespace) -> NoReturn:
    """Run :func:`run_serve`, then end the process at once with its status.

    By the time ``run_serve`` returns, the socket is closed and the engine released; what may
    remain are daemon threads (a handler blocked on a dead peer, by design). Interpreter
    finalization would kill those inside whatever native frame they are in, and when that
    frame is torch's C++ the process aborts ("terminate called without an active exception",
    status -6) instead of exiting 0: seen in CI after a clean SIGINT stop. So the process
    ends here, without finalization, once its output is flushed.
    """
    status = run_serve(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m wtcore_http_client.server [serve options]``, same as ``wtcore serve``."""
    parser = argparse.ArgumentParser(
        prog="python -m wtcore_http_client.server", description="Run a wtcore receiver server."
    )
    add_serve_arguments(parser)
    return serve_and_exit(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
