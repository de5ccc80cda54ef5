"""The memory a process lends to workers for source reads, registered only while lent.

A trainer's source reads (:mod:`wtcore_mooncake.trainer`) register the storages a bucket's
tensors lie in, announce their regions, and unregister them once the bucket was read. The
registrations are the process's transfer engine's (:func:`wtcore_mooncake.te.start`: one per
process, address and protocol), so what they lend is kept here, one :class:`Lender` per
transfer engine, not on one trainer engine: a failed round's loans outlive the trainer engine
that made them. A worker's read may outlive the round that failed (a timed-out read, a link
that comes back), so the memory it reads must stay alive while it may run. After a failed
round the trainer closes the transfer engine (:func:`wtcore_mooncake.te.close`), which ends
every such read; the lender is retired then, and its loans stay alive until the engine is gone.
Where the engine stays open (something else in the process holds it) or a trainer shuts down
mid-round, a failed round's loans stay registered and alive until the next round has ended, on
any trainer engine of the process; if none comes, they stay (at most the two buckets that were
in flight) until the process ends.
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
        bytes]``, or ``None`` (nothing kept registered) if one cannot be read where it lies:
        off the CPU, or memory Mooncake will not register (it overlaps memory registered
        already, say)."""
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
        """Give back this round's loans, all but the ``keep`` newest."""
        with self._lock:
            while len(self.loans) > keep:
                self._unregister(self.loans.pop(0)[0])

    def round_failed(self) -> None:
        """Keep this round's loans until the next round has ended (see the module docstring)."""
        with self._lock:
            self.failed += self.loans
            self.loans = []

    def round_ended(self) -> None:
        """Every worker returned: give back this round's loans and any failed round's."""
        with self._lock:
            for bases, _ in [*self.failed, *self.loans]:
                self._unregister(bases)
            self.failed, self.loans = [], []

    def retire(self) -> list[Loan]:
        """The engine is being closed (:func:`wtcore_mooncake.te.close`): forget it, and return
        every loan, whose tensors the caller keeps alive until the engine is gone."""
        with self._lock:
            loans, self.failed, self.loans, self.count = [*self.failed, *self.loans], [], [], {}
            self.engine = None
            return loans

    def _unregister(self, bases: list[int]) -> None:
        """Unregister each of ``bases`` that no other loan still holds."""
        for base in bases:
            self.count[base] -= 1
            if not self.count[base]:
                del self.count[base]
                self.engine.unregister_memory(base)
