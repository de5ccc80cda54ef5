"""The memory a process lends to workers for source reads, registered only while lent.

One :class:`Lender` per transfer engine, not per trainer engine: a worker's read may outlive
the round that failed, so a failed round's loans stay alive until the engine is closed, or
(an engine held elsewhere) until the next round has ended, on any trainer engine.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Lender"]

Loan = tuple[list[int], list["torch.Tensor"]]  # the storages a bucket registered, its tensors


class Lender:
    """Registers storages for the buckets in flight; counts how many loans hold each one."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.loans: list[Loan] = []  # this round's, oldest first
        self.failed: list[Loan] = []  # failed rounds', until the next round has ended
        self.count: dict[int, int] = {}  # loans holding each registered storage
        self._lock = threading.Lock()

    def lend(self, tensors: list[torch.Tensor]) -> list[list[int]] | None:
        """Register the storages ``tensors`` lie in for one bucket; each tensor's ``[address,
        bytes]``, or ``None`` (nothing kept) if one cannot be read where it lies."""
        with self._lock:
            bases: list[int] = []
            regions: list[list[int]] = []
            for t in tensors:
                n = t.numel() * t.element_size()
                if not n:
                    regions.append([0, 0])
                    continue
                if t.device.type != "cpu":
                    break
                storage = t.untyped_storage()
                base = storage.data_ptr()
                if base not in bases:
                    held = base in self.count  # by another loan: registered already
                    if not held and self.engine.register_memory(base, storage.nbytes()) != 0:
                        break
                    bases.append(base)
                    self.count[base] = self.count.get(base, 0) + 1
                regions.append([t.data_ptr(), n])
            if len(regions) < len(tensors):
                self._unregister(bases)
                return None
            self.loans.append((bases, tensors))
            return regions

    def give_back(self, keep: int) -> None:
        with self._lock:
            while len(self.loans) > keep:
                self._unregister(self.loans.pop(0)[0])

    def round_failed(self) -> None:
        with self._lock:
            self.failed += self.loans
            self.loans = []

    def round_ended(self) -> None:
        with self._lock:
            for bases, _ in [*self.failed, *self.loans]:
                self._unregister(bases)
            self.failed, self.loans = [], []

    def retire(self) -> list[Loan]:
        """The engine is being closed: every loan, for the caller to keep until it is gone."""
        with self._lock:
            loans, self.failed, self.loans, self.count = [*self.failed, *self.loans], [], [], {}
            self.engine = None
            return loans

    def _unregister(self, bases: list[int]) -> None:
        for base in bases:
            self.count[base] -= 1
            if not self.count[base]:
                del self.count[base]
                self.engine.unregister_memory(base)
