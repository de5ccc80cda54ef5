"""Real training steps for tests and the bench: how much of a bf16 model changes per RL step.

A small causal transformer is trained for real (AdamW at an RL-like learning rate, seeded) and
its weights cast to bf16 after each step; most elements do not change between two steps, which
is what delta rounds exploit. Runs in seconds on a CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["changed_fraction", "realistic_steps"]


def realistic_steps(
    steps: int = 12,
    *,
    lr: float = 1e-5,
    seed: int = 0,
    d_model: int = 128,
    layers: int = 2,
    vocab: int = 1024,
    seq: int = 64,
    batch: int = 8,
) -> list[dict[str, torch.Tensor]]:
    """``steps + 1`` bf16 states: the initial weights, then the weights after each step."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layer = torch.nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True, dropout=0.0
        )
        model = torch.nn.ModuleDict(
            {
                "embed": torch.nn.Embedding(vocab, d_model),
                "blocks": torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                "head": torch.nn.Linear(d_model, vocab, bias=False),
            }
        )
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(seq)

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}

    out = [snapshot()]
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        h = model["blocks"](model["embed"](tokens[:, :-1]), mask=mask, is_causal=True)
        logits = model["head"](h)
        targets = tokens[:, 1:].reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        out.append(snapshot())
    return out


def changed_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """The fraction of elements whose bits differ between two states."""
    from wtcore_delta.codec import bits

    changed = total = 0
    for name, a in after.items():
        changed += int((bits(a) != bits(before[name])).sum())
        total += a.numel()
    return changed / total if total else 0.0
