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

Three modes (:attr:`LoopConfig.mode`):

- ``"synced"``: the steps above, one after the other (on-policy).
- ``"control"``: step 5 skips the sync: vLLM keeps sampling from the initial policy while the
  trainer's copy moves away from it, so the mismatch grows and the reward stays flat.
- ``"async"`` (one step off-policy, PipelineRL-style): after the optimizer step, a staged round
  (``staged=True``, docs/staged.md) runs on a thread while vLLM, still serving the old weights,
  samples the next batch; vLLM pauses only for the commit, then the loop joins the thread and
  resets vLLM's prefix cache (KV computed with the old weights). A batch is sampled under the
  version before the previous step's (and, where the commit lands mid-request, partly under
  that step's), so the mismatch is nonzero; every step records the versions before and after
  its batch's request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests
import torch

__all__ = ["MODES", "PROMPTS", "TARGET_IDS", "LoopConfig", "StepRecord", "final_gap", "run_loop"]

#: Prompts, as token ids of the tiny checkpoint's word-level vocabulary (``w<i>`` is id 3 + i).
PROMPTS: list[list[int]] = [[5, 6, 7, 8], [100, 3, 42], [250, 17, 17, 9, 200, 31], [60, 61]]
#: The words the reward counts: ``w0`` .. ``w31``, one token in eight of the vocabulary.
TARGET_IDS: frozenset[int] = frozenset(range(3, 3 + 32))
HTTP_TIMEOUT_S = 300.0
#: :attr:`LoopConfig.mode`'s values (module docstring).
MODES = ("control", "synced", "async")


@dataclass(frozen=True)
class LoopConfig:
    steps: int = 15
    group_size: int = 8
    max_tokens: int = 16
    lr: float = 1e-2
    seed: int = 0
    mode: str = "synced"  # one of MODES

    @property
    def sync(self) -> bool:
        return self.mode != "control"


@dataclass(frozen=True)
class StepRecord:
    """One step. The times are seconds; ``step_s`` runs from the end of the previous step (the
    first step's from the start), so the steps' ``step_s`` add up to the run's loop time."""

    step: int
    reward: float  # mean over every sample of the step
    mismatch_mean: float  # mean |logprob_vllm - logprob_trainer| over the sampled tokens
    mismatch_max: float
    loss: float
    generate_s: float  # this step's batch's request (async: it ran during the previous sync)
    train_s: float
    #: synced: pause + send_weights + resume; async: the staged send_weights (on its thread)
    #: + reset_prefix_cache; 0 when the sync is off.
    sync_s: float
    #: How long vLLM could not generate because of this step's sync. synced: the whole
    #: pause-to-resume time (vLLM is paused around the round), as this loop measures it;
    #: async: the largest ``paused_s`` any vLLM worker reported for the round (its commit).
    #: 0 when the sync is off; None where the workers report no times.
    paused_s: float | None
    commit_s: float | None  # the largest commit (finish) time any vLLM worker reported
    staged_s: float | None  # the largest staging time any worker reported (async only)
    #: async: the completion tokens vLLM streamed back while this step's sync was running
    #: (counted as they arrived, in the next batch's streamed request); 0 otherwise.
    tokens_in_flight: int
    step_s: float
    sync_share: float  # sync_s / step_s
    vllm_version: str | None  # what /weight_info reports at the end of the step
    #: vLLM's weight version just before and just after this step's batch's request.
    sampled_versions: tuple[str | None, str | None]


@dataclass(frozen=True)
class Samples:
    """One step's completions, grouped by prompt: ``tokens[p][g]`` and ``logprobs[p][g]``."""

    tokens: list[list[list[int]]]
    logprobs: list[list[list[float]]]


def sample(
    url: str, model_name: str, cfg: LoopConfig, step: int, busy: Callable[[], bool] = lambda: False
) -> tuple[Samples, int]:
    """``group_size`` completions per prompt, with their vLLM logprobs, in one streamed request;
    and how many of their tokens arrived while ``busy()`` was true (a sync in flight).

    The request seed depends on the run's seed and the step only, so every run draws the same
    first batch; vLLM gives each of the ``n`` samples a seed of its own.
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
        "stream": True,  # each choice's new tokens as vLLM produces them
    }
    g, n = cfg.group_size, len(PROMPTS) * cfg.group_size
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    in_flight = 0
    with requests.post(
        url + "/v1/completions", json=body, stream=True, timeout=HTTP_TIMEOUT_S
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"/v1/completions: {chunk['error']}")
            for c in chunk["choices"]:
                new = c.get("token_ids") or []
                ids[c["index"]] += new
                lps[c["index"]] += c["logprobs"]["token_logprobs"] if new else []
                in_flight += len(new) if busy() else 0
    if any(len(t) != cfg.max_tokens or len(lp) != len(t) for t, lp in zip(ids, lps, strict=True)):
        raise RuntimeError(f"/v1/completions: expected {n} choices of {cfg.max_tokens} tokens")
    tokens = [ids[p * g : (p + 1) * g] for p in range(len(PROMPTS))]
    return Samples(tokens, [lps[p * g : (p + 1) * g] for p in range(len(PROMPTS))]), in_flight


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
    """Run ``cfg.steps`` steps from the initial weights; ``client`` is a VLLMWeightSyncClient
    (its ``weight_info`` has each worker's round times), ``engine`` a trainer engine whose
    rounds are staged exactly when ``cfg.mode`` is ``"async"``.

    Both the trainer's copy and vLLM start from ``initial_state``: the trainer loads it, and one
    sync (version ``"0"``) puts it into vLLM, whatever an earlier run left there.
    """
    model.load_state_dict(initial_state)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    model_name = requests.get(url + "/v1/models", timeout=HTTP_TIMEOUT_S).json()["data"][0]["id"]
    staged = cfg.mode == "async"
    _sync(url, client, engine, "0", staged=staged)

    def draw(step: int, sync: Future[Any] | None = None) -> tuple[Samples, int, float, Any]:
        """Step ``step``'s batch, the tokens that came while ``sync`` ran, seconds, versions."""
        t0, before = time.perf_counter(), _version(url)
        busy = (lambda: not sync.done()) if sync is not None else (lambda: False)
        samples, in_flight = sample(url, model_name, cfg, step, busy)
        return samples, in_flight, time.perf_counter() - t0, (before, _version(url))

    records: list[StepRecord] = []
    t_end = time.perf_counter()
    samples, _, generate_s, sampled = draw(1)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sync") as pool:
        for step in range(1, cfg.steps + 1):
            t1 = time.perf_counter()
            r = rewards(samples)
            loss, gap_mean, gap_max = train_step(model, optimizer, samples, group_advantages(r))
            t2 = time.perf_counter()
            times, nxt, in_flight = _NO_SYNC, None, 0
            if staged:  # the sync on its thread, the next batch meanwhile
                job = pool.submit(_sync, url, client, engine, str(step), staged=True)
                if step < cfg.steps:
                    nxt = draw(step + 1, job)
                    in_flight = nxt[1]
                times = job.result()
            else:
                if cfg.sync:
                    times = _sync(url, client, engine, str(step), staged=False)
                if step < cfg.steps:
                    nxt = draw(step + 1)
            version = _version(url)
            t_prev, t_end = t_end, time.perf_counter()
            rec = StepRecord(
                step=step,
                reward=float(r.mean()),
                mismatch_mean=gap_mean,
                mismatch_max=gap_max,
                loss=loss,
                generate_s=generate_s,
                train_s=t2 - t1,
                sync_s=times[0],
                paused_s=times[1],
                commit_s=times[2],
                staged_s=times[3],
                tokens_in_flight=in_flight,
                step_s=t_end - t_prev,
                sync_share=times[0] / (t_end - t_prev),
                vllm_version=version,
                sampled_versions=sampled,
            )
            records.append(rec)
            on_step(rec)
            if nxt is not None:
                samples, _, generate_s, sampled = nxt
    return records


def final_gap(url: str, model: torch.nn.Module, cfg: LoopConfig) -> float:
    """The largest |logprob_vllm - logprob_trainer| over a fresh batch (its seed is step
    ``cfg.steps + 1``'s): below fp32 rounding only when vLLM serves the trainer's weights."""
    model_name = requests.get(url + "/v1/models", timeout=HTTP_TIMEOUT_S).json()["data"][0]["id"]
    samples, _ = sample(url, model_name, cfg, cfg.steps + 1)
    gaps = []
    with torch.no_grad():
        for p, prompt in enumerate(PROMPTS):
            logp = token_logprobs(model, prompt, torch.tensor(samples.tokens[p]))
            gaps.append((logp - torch.tensor(samples.logprobs[p])).abs().max())
    return float(torch.stack(gaps).max())


#: (sync_s, paused_s, commit_s, staged_s) of a step without a sync.
_NO_SYNC: tuple[float, float | None, float | None, float | None] = (0.0, 0.0, None, None)


def _version(url: str) -> str | None:
    v = requests.get(url + "/weight_info", timeout=HTTP_TIMEOUT_S).json().get("weight_version")
    return None if v is None else str(v)


def _sync(
    url: str, client: Any, engine: Any, version: str, *, staged: bool
) -> tuple[float, float | None, float | None, float | None]:
    """One round; returns (sync_s, paused_s, commit_s, staged_s) as :class:`StepRecord` has them.

    Classic (``staged=False``): bracketed by pause/resume (resume also clears vLLM's prefix
    cache), so paused is the whole round. Staged: vLLM generates on while the round lands and
    pauses for its commit only; the prefix cache is reset after it.
    """
    t0 = time.perf_counter()
    if staged:
        stats = engine.send_weights(weight_version=version)
        requests.post(url + "/reset_prefix_cache", timeout=HTTP_TIMEOUT_S).raise_for_status()
    else:
        client.pause()
        try:
            stats = engine.send_weights(weight_version=version)
        finally:
            client.resume()
    sync_s = time.perf_counter() - t0
    reported = stats.receiver_times or []

    def largest(key: str) -> float | None:
        values = [t[key] for t in reported if t.get(key) is not None]
        return max(values) if values else None

    paused = largest("paused_s") if staged else sync_s
    return sync_s, paused, largest("commit_s"), largest("staged_s")
