"""A small GRPO-style RL loop: vLLM samples, the trainer learns, wtcore syncs every step.

Each step:

1. vLLM samples ``group_size`` completions per prompt at temperature 1 and reports the token
   ids it sampled, their logprobs, and which weight version sampled which tokens (its token
   route, ``/inference/v1/generate``: the server runs with ``--enable-scale-out``).
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
  that step's), so the mismatch is nonzero; every step records how many of its batch's tokens
  each version sampled, as vLLM labelled them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise
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
    #: How many of this step's batch's completion tokens each weight version sampled (vLLM's
    #: per-token labels): ``{"3": 512}``, or split where a commit landed mid-batch.
    token_versions: dict[str, int]


#: A weight version and the output tokens ``[start, end)`` it sampled (vLLM's ``weight_versions``).
Span = tuple[str, int, int]
#: vLLM's token route: per-output weight versions (served with ``--enable-scale-out`` only).
GENERATE = "/inference/v1/generate"


@dataclass(frozen=True)
class Samples:
    """One step's completions, grouped by prompt: ``tokens[p][g]``, ``logprobs[p][g]``, and
    ``spans[p][g]``, the weight versions that sampled the completion's tokens (contiguous)."""

    tokens: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    spans: list[list[list[Span]]]


def sample(
    url: str, model_name: str, cfg: LoopConfig, step: int, busy: Callable[[], bool] = lambda: False
) -> tuple[Samples, int]:
    """``group_size`` completions per prompt, with their vLLM logprobs and weight versions; and
    how many of their tokens arrived while ``busy()`` was true (a sync in flight).

    One streamed request a prompt, all sent at once (a thread each) so that vLLM batches them.
    Every request has the same seed, which depends on the run's seed and the step only, so every
    run draws the same first batch; vLLM gives sample ``i`` of a request the seed ``seed + i``.
    """
    params = {
        "n": cfg.group_size,
        "max_tokens": cfg.max_tokens,
        "temperature": 1.0,
        "logprobs": 0,  # just the sampled token's
        "ignore_eos": True,  # every completion is max_tokens long
        "seed": cfg.seed * 100_000 + step * 1_000,
    }
    bodies = [
        {"model": model_name, "token_ids": prompt, "sampling_params": params, "stream": True}
        for prompt in PROMPTS
    ]
    pool = ThreadPoolExecutor(max_workers=len(bodies), thread_name_prefix="sample")
    try:
        jobs = [pool.submit(_generate, url, body, cfg.max_tokens, busy) for body in bodies]
        groups = [job.result(timeout=HTTP_TIMEOUT_S) for job in jobs]  # raises the thread's error
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    samples = Samples([g[0] for g in groups], [g[1] for g in groups], [g[2] for g in groups])
    return samples, sum(g[3] for g in groups)


def _generate(
    url: str, body: dict[str, Any], max_tokens: int, busy: Callable[[], bool]
) -> tuple[list[list[int]], list[list[float]], list[list[Span]], int]:
    """One prompt's request: its completions' tokens, logprobs and version spans, and how many
    tokens arrived while ``busy()`` was true."""
    n = body["sampling_params"]["n"]
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    reported: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    in_flight = 0
    with requests.post(url + GENERATE, json=body, stream=True, timeout=HTTP_TIMEOUT_S) as r:
        if r.status_code == 404:
            raise RuntimeError(
                f"{GENERATE}: 404 ({r.text[:200]}); vLLM serves it only when started with "
                "--enable-scale-out"
            )
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"{GENERATE}: {chunk['error']}")
            for c in chunk["choices"]:
                i, new = c["index"], c.get("token_ids") or []
                ids[i] += new
                lps[i] += [e["logprob"] for e in (c.get("logprobs") or {}).get("content") or []]
                reported[i] = c.get("weight_versions") or reported[i]  # on the choice's last chunk
                in_flight += len(new) if busy() else 0
    if any(len(t) != max_tokens or len(lp) != len(t) for t, lp in zip(ids, lps, strict=True)):
        raise RuntimeError(f"{GENERATE}: expected {n} choices of {max_tokens} tokens")
    return ids, lps, [_spans(v, max_tokens) for v in reported], in_flight


def _spans(reported: list[dict[str, Any]], tokens: int) -> list[Span]:
    """vLLM's ``weight_versions`` of one completion, checked to cover its tokens end to end."""
    if not reported:
        raise RuntimeError(f"{GENERATE}: a completion without weight_versions (unlabelled outputs)")
    spans = [(v["version"], v["start"], v["end"]) for v in reported]
    ends = [0, *(end for _, _, end in spans)]
    if [(start, end) for _, start, end in spans] != list(pairwise(ends)) or ends[-1] != tokens:
        raise RuntimeError(f"{GENERATE}: weight_versions {reported} do not cover {tokens} tokens")
    return spans


def token_versions(samples: Samples) -> dict[str, int]:
    """How many of the batch's completion tokens each weight version sampled."""
    counts: Counter[str] = Counter()
    for version, start, end in (s for group in samples.spans for spans in group for s in spans):
        counts[version] += end - start
    return dict(counts)


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

    def draw(step: int, sync: Future[Any] | None = None) -> tuple[Samples, int, float]:
        """Step ``step``'s batch, the tokens that came while ``sync`` ran, and its seconds."""
        t0 = time.perf_counter()
        busy = (lambda: not sync.done()) if sync is not None else (lambda: False)
        samples, in_flight = sample(url, model_name, cfg, step, busy)
        return samples, in_flight, time.perf_counter() - t0

    records: list[StepRecord] = []
    t_end = time.perf_counter()
    samples, _, generate_s = draw(1)
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
                token_versions=token_versions(samples),
            )
            records.append(rec)
            on_step(rec)
            if nxt is not None:
                samples, _, generate_s = nxt
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
