"""A small GRPO-style RL loop: vLLM samples, the trainer learns, wtcore syncs every step.

Each step:

1. vLLM samples ``group_size`` completions per prompt at temperature 1 and reports the token
   ids it sampled and their logprobs (``/v1/completions``).
2. The reward of a completion is the share of its tokens that belong to :data:`TARGET_IDS`: a
   number anyone can check by reading the tokens.
3. Advantages are group-normalised (reward minus the group's mean, over the group's std).
4. The trainer runs its copy of the policy over the same tokens. Before any update, those
   logprobs must equal vLLM's: both hold the same weights. Their gap (the training-inference
   mismatch) is what a stale or torn sync shows first, so every step records it.
5. One optimizer step on the policy-gradient loss, then ``pause`` -> ``send_weights`` ->
   ``resume``, and the version vLLM now reports.

With ``sync=False`` (the control run) step 5 skips the sync: vLLM keeps sampling from the initial
policy while the trainer's copy moves away from it, so the mismatch grows and the reward stays
flat.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import requests
import torch

__all__ = ["PROMPTS", "TARGET_IDS", "LoopConfig", "StepRecord", "run_loop"]

#: Prompts, as token ids of the tiny checkpoint's word-level vocabulary (``w<i>`` is id 3 + i).
PROMPTS: list[list[int]] = [[5, 6, 7, 8], [100, 3, 42], [250, 17, 17, 9, 200, 31], [60, 61]]
#: The words the reward counts: ``w0`` .. ``w31``, one token in eight of the vocabulary.
TARGET_IDS: frozenset[int] = frozenset(range(3, 3 + 32))
HTTP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LoopConfig:
    steps: int = 15
    group_size: int = 8
    max_tokens: int = 16
    lr: float = 1e-2
    seed: int = 0
    sync: bool = True


@dataclass(frozen=True)
class StepRecord:
    step: int
    reward: float  # mean over every sample of the step
    mismatch_mean: float  # mean |logprob_vllm - logprob_trainer| over the sampled tokens
    mismatch_max: float
    loss: float
    generate_s: float
    train_s: float
    sync_s: float  # pause + send_weights + resume; 0 when the sync is off
    step_s: float
    sync_share: float  # sync_s / step_s
    vllm_version: str | None  # what /weight_info reports at the end of the step


@dataclass(frozen=True)
class Samples:
    """One step's completions, grouped by prompt: ``tokens[p][g]`` and ``logprobs[p][g]``."""

    tokens: list[list[list[int]]]
    logprobs: list[list[list[float]]]


def sample(url: str, model_name: str, cfg: LoopConfig, step: int) -> Samples:
    """``group_size`` completions per prompt, with their vLLM logprobs, in one request.

    The request seed depends on the run's seed and the step only, so a control run and a synced
    run draw the same first batch; vLLM gives each of the ``n`` samples a seed of its own.
    """
    body = {
        "model": model_name,
        "prompt": PROMPTS,
        "n": cfg.group_size,
        "max_tokens": cfg.max_tokens,
        "temperature": 1.0,
        "logprobs": 0,  # just the sampled token's
        "ignore_eos": True,  # every completion is max_tokens long
        "return_token_ids": True,
        "seed": cfg.seed * 100_000 + step * 1_000,
    }
    r = requests.post(url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
    r.raise_for_status()
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    if len(choices) != len(PROMPTS) * cfg.group_size:
        raise RuntimeError(f"/v1/completions: expected {len(PROMPTS) * cfg.group_size} choices")
    g = cfg.group_size
    tokens = [
        [list(c["token_ids"]) for c in choices[p * g : (p + 1) * g]] for p in range(len(PROMPTS))
    ]
    logprobs = [
        [list(c["logprobs"]["token_logprobs"]) for c in choices[p * g : (p + 1) * g]]
        for p in range(len(PROMPTS))
    ]
    return Samples(tokens, logprobs)


def rewards(samples: Samples) -> torch.Tensor:
    """``[prompts, group]``: the share of each completion's tokens that are target words."""
    return torch.tensor(
        [
            [sum(t in TARGET_IDS for t in toks) / len(toks) for toks in group]
            for group in samples.tokens
        ],
        dtype=torch.float32,
    )


def group_advantages(r: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage: each reward against its group's mean, in units of the group's std."""
    return (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)


def token_logprobs(
    model: torch.nn.Module, prompt: Sequence[int], completions: torch.Tensor
) -> torch.Tensor:
    """``[group, tokens]``: the trainer's logprob of each sampled token (with gradients)."""
    group = completions.shape[0]
    ids = torch.cat([torch.tensor(prompt).expand(group, -1), completions], dim=1)
    logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: Samples, adv: torch.Tensor
) -> tuple[float, float, float]:
    """Policy-gradient step; returns (loss, mismatch mean, mismatch max) measured before it."""
    optimizer.zero_grad(set_to_none=True)
    gaps: list[torch.Tensor] = []
    total = torch.zeros(())
    for p, prompt in enumerate(PROMPTS):
        completions = torch.tensor(samples.tokens[p])
        logp = token_logprobs(model, prompt, completions)
        gaps.append((logp.detach() - torch.tensor(samples.logprobs[p])).abs().flatten())
        total = total - (adv[p].unsqueeze(1) * logp).mean()
    loss = total / len(PROMPTS)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    gap = torch.cat(gaps)
    return float(loss.detach()), float(gap.mean()), float(gap.max())


def run_loop(
    *,
    url: str,
    model: torch.nn.Module,
    initial_state: dict[str, torch.Tensor],
    client: Any,
    engine: Any,
    cfg: LoopConfig,
    on_step: Callable[[StepRecord], None] = lambda rec: None,
) -> list[StepRecord]:
    """Run ``cfg.steps`` steps from the initial weights; ``client`` is an HTTPWeightSyncClient.

    Both the trainer's copy and vLLM start from ``initial_state``: the trainer loads it, and one
    sync (version ``"0"``) puts it into vLLM, whatever an earlier run left there.
    """
    model.load_state_dict(initial_state)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    model_name = requests.get(url + "/v1/models", timeout=HTTP_TIMEOUT_S).json()["data"][0]["id"]
    _sync(client, engine, "0")
    records: list[StepRecord] = []
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        samples = sample(url, model_name, cfg, step)
        t1 = time.perf_counter()
        r = rewards(samples)
        loss, gap_mean, gap_max = train_step(model, optimizer, samples, group_advantages(r))
        t2 = time.perf_counter()
        if cfg.sync:
            _sync(client, engine, str(step))
        t3 = time.perf_counter()
        version = client.weight_info()[0].get("weight_version")
        rec = StepRecord(
            step=step,
            reward=float(r.mean()),
            mismatch_mean=gap_mean,
            mismatch_max=gap_max,
            loss=loss,
            generate_s=t1 - t0,
            train_s=t2 - t1,
            sync_s=t3 - t2,
            step_s=t3 - t0,
            sync_share=(t3 - t2) / (t3 - t0),
            vllm_version=None if version is None else str(version),
        )
        records.append(rec)
        on_step(rec)
    return records


def _sync(client: Any, engine: Any, version: str) -> None:
    """One round, bracketed by pause/resume (resume also clears vLLM's prefix cache)."""
    client.pause()
    try:
        engine.send_weights(weight_version=version)
    finally:
        client.resume()
