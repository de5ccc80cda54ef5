"""Every fenced code block in README.md and docs/*.md is checked by a rule, or this test fails.

The rules, by language:

- ``python``: executed (per page, in order, in one fresh namespace, under the fixture the page
  names below); or run by a test of its own that this test recognises (the test file must
  name the page); or, for blocks that need a Ray cluster with GPUs or a vLLM server, compiled
  and every ``wtcore*`` import resolved, so a renamed API still fails here.
- ``sh`` / ``bash`` / ``console``: each command is checked without running it: ``wtcore ...``
  parses with the CLI's own parser (plugins' commands included), ``make X`` is ``make -n X``,
  a repository script exists, ``curl`` reaches a route the reference receiver serves, and
  ``vllm serve`` is vLLM's own command (the page's vLLM tests run it).
- ``json`` / ``toml``: parsed and compared with the code (a ``weight_info`` answer has exactly
  ``WeightSyncWorker.weight_info()``'s keys; a config names a registered backend and only its
  init-info fields; a ``pyproject.toml`` registers entry points in wtcore's groups).
- ``text``: not checked. An untagged block is allowed only where listed below.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import re
import shlex
import subprocess
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def first(self) -> str:
        return next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")


def blocks(pages: list[Path] = PAGES, root: Path = ROOT) -> list[Block]:
    out: list[Block] = []
    for page in pages:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = _FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            fence, indent = m.group(2), len(m.group(1))
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                j += 1
            body = "\n".join(ln[indent:] for ln in lines[i + 1 : j])
            out.append(Block(page.relative_to(root).as_posix(), i + 1, m.group(3), body + "\n"))
            i = j + 1
    return out


ALL = blocks()

# --- what each page needs ------------------------------------------------------------------

#: Python blocks run by a test of their own: (page, text in the block's first line) -> test.
RUN_ELSEWHERE: dict[tuple[str, str], str] = {
    ("README.md", "import torch"): "tests/core/test_readme.py",
    ("docs/writing-an-engine.md", ""): "tests/core/test_tutorial.py",  # every block, in order
    ("docs/http.md", "import os"): "tests/http_client/test_fastapi_mount.py",
    ("docs/ray.md", "import ray, torch"): "tests/multinode/test_ray_nodes.py",
    # examples/trl_grpo/train.py executes the block as it stands, with a real GRPOTrainer
    ("docs/trl.md", "import wtcore_trl"): "tests/vllm/test_trl_grpo.py",
    ("docs/trl.md", "from peft import LoraConfig"): "tests/vllm/test_vllm_lora.py",
    # the checkpoint, then the trainer as two torchrun ranks into the page's `wtcore serve` lines
    ("docs/sharded.md", "# checkpoint.py"): "tests/docs/test_sharded_page.py",
    ("docs/sharded.md", "import gc"): "tests/docs/test_sharded_page.py",
}

#: Python blocks that need hardware or services no test machine is assumed to have: compiled,
#: their wtcore imports resolved. (page, text in the first line) -> why.
NEEDS_CLUSTER: dict[tuple[str, str], str] = {
    ("docs/ray.md", "import functools, ray, torch"): "a Ray cluster with GPUs",
    ("docs/ray.md", "from wtcore_ray_client import WeightSyncActor"): "a Ray cluster with GPUs",
    ("docs/vllm.md", "from wtcore import ModuleSource"): "a vLLM server with the nccl engine",
    ("docs/vllm.md", "from peft import"): "a vLLM server serving LoRA adapters",
    # tests/multinode/fsdp_trainer.py runs the same steps on namespaced nodes.
    ("docs/nccl.md", "import os"): "two trainer nodes and two receiver nodes",
}

#: Untagged blocks (should be ``text``; the pages belong to other work in progress).
UNTAGGED_OK: dict[tuple[str, str], str] = {
    ("docs/http.md", "start_weight_update failed on"): "sample error output",
    ("docs/protocol.md", "init_weight_transfer_engine(init_info)"): "call-order diagram",
    ("docs/ray.md", "update_weights failed on"): "sample error output",
}

#: Blocks that fail their rule today; strict xfail, so the entry must go once fixed.
KNOWN_DOC_BUGS: dict[str, str] = {}


def _claimed(table: dict[tuple[str, str], str], b: Block) -> str | None:
    for (page, start), value in table.items():
        if page == b.page and b.first.startswith(start):
            return value
    return None


def _bug(b: Block) -> Any:
    reason = KNOWN_DOC_BUGS.get(b.where)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


# --- python --------------------------------------------------------------------------------


def _http_page(tmp_path: Path) -> Generator[dict[str, Any], None, None]:
    """docs/http.md's free names (a model, an init info, a source, as a trainer has them) and
    two real receivers, served with the page's API key, in place of the page's replica URLs."""
    import torch

    from wtcore import ModuleSink, ModuleSource, WeightSyncWorker, WeightTransferTrainerFactory
    from wtcore_http_client import ReceiverHTTPServer, ReceiverRoutes
    from wtcore_kit.inline import InlineTrainerInitInfo

    workers = [WeightSyncWorker("inline", ModuleSink(torch.nn.Linear(4, 4))) for _ in range(2)]
    servers = [
        ReceiverHTTPServer(ReceiverRoutes(w, api_key="..."), host="127.0.0.1", port=0)
        for w in workers
    ]
    for server in servers:
        server.start()
    try:
        yield {
            "model": torch.nn.Linear(4, 4),
            "info": InlineTrainerInitInfo(rank=0),
            "source": ModuleSource(torch.nn.Linear(4, 4)),
            "WeightTransferTrainerFactory": WeightTransferTrainerFactory,
            REPLACE: {
                "http://10.0.0.2:8000": servers[0].url,
                "http://10.0.0.3:8000": servers[1].url,
            },
        }
    finally:
        for server in servers:
            server.stop()
        for w in workers:
            w.shutdown()


#: The fixture's text substitutions for a page (addresses that only exist in a deployment).
REPLACE = "__replace__"


def _self_contained(tmp_path: Path) -> Generator[dict[str, Any], None, None]:
    """A page whose blocks need no free names (they build what they use and tear it down)."""
    yield {}


#: Pages whose other python blocks run here, in order, with these free names.
EXECUTED: dict[str, Callable[[Path], Generator[dict[str, Any], None, None]]] = {
    "docs/http.md": _http_page,
    "docs/ipc.md": _self_contained,
    "docs/tcp.md": _self_contained,
    "docs/mooncake.md": _self_contained,
    "docs/sharded.md": _self_contained,
    "docs/staged.md": _self_contained,
}


def _python_pages() -> list[str]:
    return sorted({b.page for b in ALL if b.lang == "python"})


@pytest.mark.processes
@pytest.mark.parametrize("page", _python_pages())
def test_python_blocks(page: str, tmp_path: Path) -> None:
    mine = [b for b in ALL if b.page == page and b.lang == "python"]
    run_here: list[Block] = []
    for b in mine:
        compile(b.code, b.where, "exec")  # every block is at least valid Python
        test = _claimed(RUN_ELSEWHERE, b)
        if test is not None:
            text = (ROOT / test).read_text()
            assert Path(page).name in text, f"{b.where}: {test} does not name {page}"
            continue
        if _claimed(NEEDS_CLUSTER, b) is not None:
            _check_wtcore_imports(b)
            continue
        assert page in EXECUTED, f"{b.where}: no rule runs this python block"
        run_here.append(b)
    if not run_here:
        return
    fixture = EXECUTED[page](tmp_path)
    namespace: dict[str, Any] = {"__name__": f"docs_{Path(page).stem}", **next(fixture)}
    try:
        replace: dict[str, str] = namespace.pop(REPLACE, {})
        for b in run_here:
            code = b.code
            for old, new in replace.items():
                code = code.replace(old, new)
            exec(compile(code, b.where, "exec"), namespace)
    finally:
        fixture.close()
        for obj in namespace.values():  # the blocks' own servers and engines
            for name in ("shutdown",):
                if type(obj).__module__.startswith("wtcore") and callable(getattr(obj, name, 0)):
                    getattr(obj, name)()


def _check_wtcore_imports(b: Block) -> None:
    for node in ast.walk(ast.parse(b.code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("wtcore"):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                assert hasattr(module, alias.name), f"{b.where}: {node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("wtcore"):
                    importlib.import_module(alias.name)


# --- shell ---------------------------------------------------------------------------------


_KEYWORDS = {"until", "while", "do", "done", "if", "then", "else", "fi", "!"}
_PLAIN_SHELL = {"sleep", "kill", "wait", "cd"}
_SEPARATORS = {";", "&&", "||", "|", "&"}
_REDIRECT = re.compile(r"\s\d*>&\d+|\s\d*>>?\s*\S+")


def _commands(b: Block) -> list[tuple[int, list[str]]]:
    """``(line, argv)`` of each simple command: continuations joined, comments, redirections,
    env assignments and shell keywords dropped, lists (``;``, ``&&``, ``|``, ``&``) split."""
    out: list[tuple[int, list[str]]] = []
    pending, start = "", 0
    for n, raw in enumerate(b.code.splitlines(), start=b.line + 1):
        line = raw.rstrip()
        if b.lang == "console" and not pending:
            if not line.startswith("$ "):
                continue  # output
            line = line[2:]
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lexer = shlex.shlex(_REDIRECT.sub(" ", pending + line), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        pending = ""
        argv: list[str] = []
        for token in [*lexer, ";"]:
            if token not in _SEPARATORS:
                argv.append(token)
                continue
            while argv and (argv[0] in _KEYWORDS or re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0])):
                argv.pop(0)
            if argv:
                out.append((start, argv))
            argv = []
    return out


def _check_wtcore(where: str, args: list[str]) -> None:
    from wtcore.cli import build_parser

    try:
        build_parser().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{where}: `wtcore {shlex.join(args)}` does not parse (exit {e.code})")


def _check_make(where: str, args: list[str]) -> None:
    r = subprocess.run(
        ["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 0, f"{where}: `make -n {shlex.join(args)}`: {r.stderr.strip()}"


def _check_curl(where: str, args: list[str]) -> None:
    from wtcore_http_client.routes import ROUTES

    urls = [a for a in args if re.match(r"^(https?://)?[\w.-]+:\d+", a)]
    assert len(urls) == 1, f"{where}: expected one URL in `curl {shlex.join(args)}`"
    path = (
        "/" + urls[0].split("://")[-1].split("/", 1)[1] if "/" in urls[0].split("://")[-1] else "/"
    )
    path = path.split("?")[0]
    method = "POST" if "POST" in args or "-d" in args else "GET"
    if path.startswith("/v1/"):
        return  # vLLM's OpenAI-compatible API, served by the vLLM server of the page
    assert path in ROUTES, f"{where}: {path} is not a route of the reference receiver"
    assert ROUTES[path][0] == method, f"{where}: {path} is a {ROUTES[path][0]} route"


def _check_ray_start(where: str, args: list[str]) -> None:
    """Ray's own parser accepts the options (tests/multinode/test_ray_nodes.py runs them)."""
    import click
    from ray.scripts.scripts import start

    try:
        start.make_context("start", list(args))
    except click.ClickException as e:
        pytest.fail(f"{where}: `ray start {shlex.join(args)}`: {e.format_message()}")


def _check_shell(where: str, argv: list[str]) -> None:
    prog, args = argv[0], argv[1:]
    if prog == "wtcore":
        _check_wtcore(where, args)
    elif prog == "make":
        _check_make(where, args)
    elif prog == "curl":
        _check_curl(where, args)
    elif prog in _PLAIN_SHELL:
        pass  # the shell's own job control and waits; nothing of the project's to check
    elif prog == "vllm" and args[:1] == ["serve"]:
        pass  # vLLM's own CLI; tests/vllm starts the same server
    elif prog == "torchrun":
        pass  # torch's launcher of the page's script, which a RUN_ELSEWHERE test runs
    elif prog == "ray" and args[:1] == ["start"]:
        _check_ray_start(where, args[1:])
    elif prog.endswith("/python") or prog == "python":
        script = next(a for a in args if not a.startswith("-"))
        if script == "-m" or args[0] == "-m":
            module = args[args.index("-m") + 1]
            assert importlib.util.find_spec(module), f"{where}: no module {module}"
        else:
            assert (ROOT / script).is_file(), f"{where}: no script {script}"
    elif (ROOT / prog).is_file():
        assert (ROOT / prog).stat().st_mode & 0o111, f"{where}: {prog} is not executable"
    else:
        pytest.fail(f"{where}: no rule checks `{shlex.join(argv)}`")


SHELL = [b for b in ALL if b.lang in ("sh", "bash", "console")]


@pytest.mark.processes
@pytest.mark.parametrize("block", [pytest.param(b, id=b.where, marks=_bug(b)) for b in SHELL])
def test_shell_blocks(block: Block) -> None:
    commands = _commands(block)
    assert commands, f"{block.where}: no command in a {block.lang} block"
    for line, argv in commands:
        _check_shell(f"{block.page}:{line}", argv)


# --- json / toml ---------------------------------------------------------------------------


def _check_json(b: Block) -> None:
    data = json.loads(b.code)
    if isinstance(data, dict) and {"weight_version", "consistent"} <= set(data):
        import torch

        from wtcore import ModuleSink, WeightSyncWorker

        worker = WeightSyncWorker("inline", ModuleSink(torch.nn.Linear(2, 2)))
        try:
            assert set(data) == set(worker.weight_info()), (
                f"{b.where}: keys differ from WeightSyncWorker.weight_info(): "
                f"{sorted(set(data) ^ set(worker.weight_info()))}"
            )
        finally:
            worker.shutdown()
        return
    pytest.fail(f"{b.where}: no rule checks this json block")


def _check_toml(b: Block) -> None:
    data = tomllib.loads(b.code)
    if "project" in data:  # a plugin's pyproject.toml, whole or its entry points only
        from wtcore.hooks import GROUP as HOOKS
        from wtcore.registry import CLIENTS, ENGINES, ROUND_POLICIES
        from wtcore_bench.support import GROUP as BENCH

        groups = {r.group for r in (CLIENTS, ENGINES, ROUND_POLICIES)} | {HOOKS, BENCH}
        eps = data["project"].get("entry-points", {})
        assert eps and set(eps) <= groups, f"{b.where}: entry-point groups {sorted(eps)}"
        if "name" in data["project"]:
            deps = data["project"].get("dependencies", [])
            assert any(re.match(r"^wtcore\s*~=", d) for d in deps), f"{b.where}: pin wtcore ~="
        return
    if "backend" in data:  # a trainer config (wtcore.config)
        from wtcore.registry import TRAINER_ENGINES

        info_cls = TRAINER_ENGINES.load(data["backend"]).init_info_cls
        fields = {f.name for f in dataclasses.fields(info_cls)}
        extra = set(data) - fields - {"backend", "client"}
        assert not extra, f"{b.where}: not fields of {info_cls.__name__}: {sorted(extra)}"
        return
    pytest.fail(f"{b.where}: no rule checks this toml block")


DATA = [b for b in ALL if b.lang in ("json", "toml")]


@pytest.mark.parametrize("block", [pytest.param(b, id=b.where, marks=_bug(b)) for b in DATA])
def test_data_blocks(block: Block) -> None:
    (_check_json if block.lang == "json" else _check_toml)(block)


# --- everything has a rule -----------------------------------------------------------------

RULED = {"python", "sh", "bash", "console", "json", "toml", "text"}


def test_every_block_has_a_rule() -> None:
    bad = [
        f"{b.where}: ```{b.lang or '(untagged)'} block, first line {b.first!r}"
        for b in ALL
        if b.lang not in RULED and not (b.lang == "" and _claimed(UNTAGGED_OK, b))
    ]
    assert not bad, "no rule covers:\n" + "\n".join(bad)


def test_the_tables_name_real_blocks() -> None:
    for table in (RUN_ELSEWHERE, NEEDS_CLUSTER, UNTAGGED_OK):
        for page, start in table:
            assert any(b.page == page and b.first.startswith(start) for b in ALL), (page, start)
    wheres = {b.where for b in ALL}
    assert set(KNOWN_DOC_BUGS) <= wheres, set(KNOWN_DOC_BUGS) - wheres


def test_the_parser_finds_fences_and_their_lines(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "x\n```python\na = 1\n```\n\n- item\n\n  ```sh\n  make test\n  ```\n````\nraw\n````\n"
    )
    assert blocks([page], tmp_path) == [
        Block("p.md", 2, "python", "a = 1\n"),
        Block("p.md", 8, "sh", "make test\n"),
        Block("p.md", 11, "", "raw\n"),
    ]
    assert len(ALL) >= 35, len(ALL)  # the real pages: every fence found


@pytest.mark.processes
@pytest.mark.parametrize(
    ("command", "complaint"),
    [
        ("wtcore bench --no-such-flag", "does not parse"),
        ("wtcore bench --size 12parsecs", "does not parse"),
        ("make no-such-target", "make -n no-such-target"),
        ("curl -s 127.0.0.1:8000/no_such_route", "is not a route"),
        ("curl -s 127.0.0.1:8000/pause", "is a POST route"),
        (".venv/bin/python tests/no_such_script.py", "no script"),
        ("frobnicate --all", "no rule checks"),
    ],
)
def test_the_shell_rules_catch_a_broken_command(command: str, complaint: str) -> None:
    block = Block("x.md", 1, "sh", command + "\n")
    ((line, argv),) = _commands(block)
    with pytest.raises(
        pytest.fail.Exception
        if "not parse" in complaint or "rule" in complaint
        else AssertionError,
        match=re.escape(complaint),
    ):
        _check_shell(f"x.md:{line}", argv)


def test_the_data_rules_catch_drift() -> None:
    with pytest.raises(AssertionError, match="keys differ"):
        _check_json(Block("x.md", 1, "json", '{"weight_version": null, "consistent": true}'))
    with pytest.raises(AssertionError, match="not fields of InlineTrainerInitInfo"):
        _check_toml(Block("x.md", 1, "toml", 'backend = "inline"\nno_such_option = 1\n'))
