"""The RL example's checkable parts (reward, advantages, streamed sampling) and its one
documented command.

The loop itself runs against a real vLLM server in tests/vllm/test_rl_loop.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load_loop():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("rl_loop_loop", ROOT / "examples/rl_loop/loop.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


loop = _load_loop()


def test_reward_is_the_share_of_target_tokens() -> None:
    hit, miss = min(loop.TARGET_IDS), max(loop.TARGET_IDS) + 1
    samples = loop.Samples(
        tokens=[[[hit, hit, miss, miss], [miss] * 4], [[hit] * 4, [hit, miss, miss, miss]]],
        logprobs=[[[0.0] * 4] * 2] * 2,
        spans=[[[("0", 0, 4)]] * 2] * 2,
    )
    assert torch.equal(loop.rewards(samples), torch.tensor([[0.5, 0.0], [1.0, 0.25]]))


def test_group_advantages_are_normalised_per_group() -> None:
    r = torch.tensor([[0.0, 1.0, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]])
    adv = loop.group_advantages(r)
    assert torch.allclose(adv.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(adv[0].std(), torch.tensor(1.0), atol=1e-4)
    assert torch.equal(adv[1], torch.zeros(4))  # no signal in a group that scored alike
    assert adv[0, 1] > adv[0, 2] > adv[0, 0]


def test_readme_and_docs_name_the_make_target_that_runs_the_example() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nrl-demo:", 1)[1].split("\n\n", 1)[0]
    assert "examples/rl_loop/run.py" in recipe
    for doc in ("README.md", "docs/vllm.md", "examples/rl_loop/README.md"):
        assert "make rl-demo" in (ROOT / doc).read_text(), doc
    assert (ROOT / "docs" / "rl_loop.png").is_file()


class _Streamed:
    """A streamed ``/inference/v1/generate`` answer: ``lines`` as vLLM sends them (server-sent
    events)."""

    def __init__(self, lines: list[bytes], status_code: int = 200) -> None:
        self.lines, self.status_code, self.text = lines, status_code, ""

    def __enter__(self) -> _Streamed:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def raise_for_status(self) -> None:
        pass

    def iter_lines(self) -> list[bytes]:
        return self.lines


def _chunk(tok: int, versions: list[dict] | None = None) -> bytes:  # type: ignore[type-arg]
    lp = {"content": [{"token_id": tok, "logprob": -tok / 10}]}
    c = {"index": 0, "token_ids": [tok], "logprobs": lp, "weight_versions": versions}
    return b"data: " + json.dumps({"choices": [c]}).encode()


#: A commit between a completion's two tokens: version 3 sampled the first, 4 the second.
SPLIT = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]


def test_sample_assembles_streamed_choices_and_counts_tokens_in_flight(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cfg = loop.LoopConfig(group_size=1, max_tokens=2)
    n = len(loop.PROMPTS)

    def post(url: str, json: dict, **kwargs: object) -> _Streamed:  # type: ignore[type-arg]
        assert url == "http://x/inference/v1/generate" and json["sampling_params"]["n"] == 1
        p = loop.PROMPTS.index(json["token_ids"])
        return _Streamed([_chunk(10 + p), b"", _chunk(20 + p, SPLIT), b"data: [DONE]"])

    monkeypatch.setattr(loop.requests, "post", post)
    seen = iter(range(2 * n))  # a sync in flight during the first n tokens only
    samples, in_flight = loop.sample("http://x", "tiny", cfg, 1, busy=lambda: next(seen) < n)
    assert samples.tokens == [[[10 + p, 20 + p]] for p in range(n)]
    assert samples.logprobs == [[[-(10 + p) / 10, -(20 + p) / 10]] for p in range(n)]
    assert samples.spans == [[[("3", 0, 1), ("4", 1, 2)]]] * n
    assert loop.token_versions(samples) == {"3": n, "4": n}
    assert in_flight == n
    assert loop.LoopConfig(mode="control").sync is False and "async" in loop.MODES


@pytest.mark.parametrize(
    ("answer", "complaint"),
    [
        (_Streamed([], status_code=404), "--enable-scale-out"),
        (_Streamed([_chunk(1), _chunk(2)]), "without weight_versions"),
        (_Streamed([_chunk(1), _chunk(2, SPLIT[1:])]), "do not cover 2 tokens"),
        (_Streamed([_chunk(1), b'data: {"error": {"message": "boom"}}']), "boom"),
    ],
)
def test_sample_refuses_what_it_cannot_trust(monkeypatch, answer, complaint) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(loop.requests, "post", lambda *a, **k: answer)
    with pytest.raises(RuntimeError, match=complaint):
        loop.sample("http://x", "tiny", loop.LoopConfig(group_size=1, max_tokens=2), 1)
