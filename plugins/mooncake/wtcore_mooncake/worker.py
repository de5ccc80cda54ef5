"""The worker half of ``mooncake``: read each announced bucket, in place or into staging.

Everything an update names is checked against the init and the plan before a byte moves.
What a read lands in is registered only while it runs (Mooncake has no authentication:
docs/mooncake.md, "Trust"). A read that outlived its timeout keeps its memory until it ends,
and after a round that read and did not finish the transfer engine is renewed before the
next round (docs/mooncake.md, "Hostile input and failures").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from wtcore.buckets import Bucket, as_bytes, unpack_bucket
from wtcore.errors import PayloadError, TransferError, TransferTimeoutError
from wtcore.parse import parse_dataclass
from wtcore.sink import direct_destination
from wtcore_kit.bucketed import BucketedWorkerEngine
from wtcore_kit.concurrency import BackgroundCall
from wtcore_kit.sharded.pairs import PlanReceiver, PlanUpdate
from wtcore_mooncake import te
from wtcore_mooncake.pairs import ReadsUpdate, SendersUpdate
from wtcore_mooncake.wire import MooncakeInitInfo, MooncakeUpdateInfo

if TYPE_CHECKING:
    import torch

__all__ = ["MooncakeWorkerEngine"]


class _StaleRead(NamedTuple):
    """A read that outlived its timeout: the memory it may still write into (kept, registered,
    until it ends), how many are the sink's own tensors, and how long the next round waits."""

    call: BackgroundCall[Any]
    into: list[Any]
    sinks: int
    wait_s: float


class MooncakeWorkerEngine(
    PlanReceiver, BucketedWorkerEngine[MooncakeInitInfo, MooncakeUpdateInfo]
):
    """Pulls buckets from the trainer's registered memory (sharded: wtcore_mooncake.pairs)."""

    init_info_cls = MooncakeInitInfo
    update_info_cls = MooncakeUpdateInfo

    _engine: Any = None
    _staging: Any = None  # a flat uint8 tensor, registered only while a read lands in it
    _lent: dict[int, torch.Tensor]  # what the read under way lands in, by address
    in_place_bytes: int = 0  # bytes read since init, into the sink's tensors / through staging
    staged_bytes: int = 0
    _reading: list[_StaleRead]  # reads that outlived their timeout, until they end
    endpoint: str = ""  # this worker's transfer engine, host:port
    _suspect: bool = False  # a read ran in a round that has not finished
    _engine_key: tuple[str, str] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading = []
        self._lent = {}
        self._senders: list[tuple[str, list[tuple[int, int]]]] | None = None
        self._round_buf: torch.Tensor | None = None

    @classmethod
    def host_status(cls) -> str:
        return te.host_status()

    def init_transfer_engine(self, init_info: MooncakeInitInfo) -> None:
        self._release()
        te.bound_stalls(init_info.timeout_s)  # before the engine starts: see te.bound_stalls
        if self._engine is None:
            self._engine_key = (te.local_address(init_info.host), init_info.protocol)
            self._engine, self.endpoint = te.start(*self._engine_key)
        self._stage(max(n for _, n in init_info.slots))
        self.in_place_bytes = self.staged_bytes = 0
        super().init_transfer_engine(init_info)

    def _stage(self, size: int) -> None:
        import torch

        self._staging = torch.empty(size, dtype=torch.uint8, device="cpu")

    def _lend(self, t: torch.Tensor) -> bool:
        """Register ``t`` (flat bytes) for the read under way; False if Mooncake refuses."""
        held = self._lent.get(t.data_ptr())
        if held is not None:
            return held.numel() == t.numel()  # the same storage (tied weights), or not
        if self._engine.register_memory(t.data_ptr(), t.numel()) != 0:
            return False
        self._lent[t.data_ptr()] = t
        return True

    def _unlend(self) -> None:
        lent, self._lent = self._lent, {}
        for ptr in lent:
            self._engine.unregister_memory(ptr)

    def _renew_engine(self) -> None:
        """Close this process's transfer engine and start a fresh one, once every read of the
        round that did not finish has ended (Mooncake cannot tell when a cut-off one stops)."""
        self._await_stale_reads()
        if self._reading:  # a read into staging still runs on the engine: renewed later
            return
        size = None if self._staging is None else self._staging.numel()
        self._release()  # unregisters everything, the ended reads' memory included
        self._engine = None  # te.close refuses an engine something still holds
        key = self._engine_key
        if key is not None:
            te.close(*key)
            self._engine, self.endpoint = te.start(*key)
            if size is not None:
                self._stage(size)
        self._suspect = False

    def _destination(self, name: str, dtype: Any, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The sink's tensor for ``name`` as bytes, registered for the read; ``None``: staging."""
        dest = direct_destination(self.sink, name, dtype, shape, "cpu")
        if dest is None or dest.numel() == 0:
            return None
        held = as_bytes(dest)
        return held if self._lend(held) else None

    # ------------------------------------------------------------------ sharded rounds
    def parse_update_info(self, data: Mapping[str, Any]) -> Any:
        plan = self.parse_plan(data)
        if plan is not None:
            return plan
        if isinstance(data, Mapping) and "senders" in data:
            return parse_dataclass(SendersUpdate, data, what="update_info")
        if isinstance(data, Mapping) and "reads" in data:
            return parse_dataclass(ReadsUpdate, data, what="update_info")
        return super().parse_update_info(data)

    def plan_buffer_size_bytes(self) -> int:
        return self.settings.packed_buffer_size_bytes

    # abort keeps the round's buffer until the next round: a read may still be writing it
    def start_weight_update(self) -> None:
        if self._suspect:
            self._renew_engine()
        else:
            self._await_stale_reads()
        self._drop_round()
        super().start_weight_update()

    def _await_stale_reads(self) -> None:
        """Wait (up to its ``timeout_s``) for every read that outlived its round and may still
        write into the sink's tensors, after this round wrote them; one still running fails."""
        for call, _, sinks, wait_s in self._reading:
            if sinks and not call.wait(wait_s):
                raise TransferTimeoutError(
                    f"a read of a failed round may still write into {sinks} of the model's "
                    f"tensors: it has not ended {wait_s:g} s later, and this round would race "
                    "with it"
                )
        self._forget_ended_reads()  # their sink tensors can be registered again

    def finish_weight_update(self) -> None:
        self._drop_round()
        super().finish_weight_update()
        self._suspect = False  # every read of the round ended, and the round did

    def _take_senders(self, update: SendersUpdate) -> None:
        """A sharded round's senders, checked, and a buffer for its largest planned bucket."""
        import torch

        assembler = self.planned("update_info.senders")
        if self._senders is not None:
            raise PayloadError("update_info.senders: this round already has its senders")
        senders = update.checked(assembler.trainer_ranks)
        largest = max(
            (b.nbytes for s in assembler.senders() for b, _ in assembler.buckets_from(s)), default=0
        )
        buf = torch.empty(max(largest, 1), dtype=torch.uint8)  # registered by each step
        self._senders, self._round_buf = senders, buf

    def _read_step(self, update: ReadsUpdate) -> None:
        """Read this step's buckets, each checked before a byte moves, and assemble them."""
        assembler = self.planned("update_info.reads")
        senders, buf = self._senders, self._round_buf
        if senders is None or buf is None:
            raise PayloadError("update_info.reads: no senders were announced in this round")
        self._lend_or_fail(buf)
        for i, r in enumerate(update.checked()):
            where = f"update_info.reads[{i}]"
            if r.src not in assembler.senders():
                raise PayloadError(f"{where}.src: trainer rank {r.src} sends nothing here")
            buckets = assembler.buckets_from(r.src)
            endpoint, slots = senders[r.src]
            if r.bucket >= len(buckets) or r.slot >= len(slots):
                raise PayloadError(
                    f"{where}: bucket {r.bucket} of {len(buckets)} planned, slot {r.slot} of "
                    f"{len(slots)} announced by trainer rank {r.src}"
                )
            n = buckets[r.bucket][0].nbytes
            if n > slots[r.slot][1]:
                raise PayloadError(
                    f"{where}: bucket {r.bucket} ({n} bytes) does not fit slot {r.slot} "
                    f"({slots[r.slot][1]} bytes) of trainer rank {r.src}"
                )
            call = BackgroundCall(
                self._engine.transfer_sync_read, endpoint, buf.data_ptr(), slots[r.slot][0], n,
                name="mooncake-read",
            )  # fmt: skip
            what = f"bucket {r.bucket} ({n} bytes) from trainer rank {r.src} at {endpoint}"
            self._wait_read(call, what, self.settings.timeout_s)
            assembler.take([(r.src, r.bucket, buf[:n])])
            self.staged_bytes += buckets[r.bucket][0].payload_nbytes

    def _drop_round(self) -> None:
        self._round_buf = self._senders = None

    def _lend_or_fail(self, t: torch.Tensor) -> None:
        if not self._lend(t):
            raise TransferError(f"Mooncake could not register {t.numel()} bytes to read into")

    def receive_weights(self, update_info: Any) -> None:
        try:
            self._receive(update_info)
        finally:
            self._unlend()  # nothing stays registered past its read (a stale read's stays)

    def _receive(self, update_info: Any) -> None:
        if isinstance(update_info, PlanUpdate):
            self.take_plan(update_info)
            return
        if isinstance(update_info, SendersUpdate):
            self._take_senders(update_info)
            return
        if isinstance(update_info, ReadsUpdate):
            self._read_step(update_info)
            return
        self.refuse_whole_tensors()
        init = self.settings
        buckets = init.plan(update_info.metas)
        expected = buckets[0].nbytes if buckets else 0
        if len(buckets) > 1 or update_info.nbytes != expected:
            raise PayloadError(
                f"update_info.nbytes: {update_info.nbytes} bytes announced, the listed tensors "
                f"are {len(buckets)} bucket(s) of {expected} bytes"
            )
        staging = self._staging
        if staging is None:
            raise TransferError(
                "mooncake: the staging was released after a failed read; init again"
            )
        if update_info.regions is not None:
            if expected > staging.numel():
                raise PayloadError(
                    f"update_info.nbytes: {expected} bytes do not fit this worker's staging "
                    f"({staging.numel()} bytes)"
                )
            if buckets:
                self._read_regions(init, buckets[0], update_info.regions, staging)
            return
        if update_info.slot >= len(init.slots):
            raise PayloadError(
                f"update_info.slot: {update_info.slot}, the init announced {len(init.slots)}"
            )
        remote, capacity = init.slots[update_info.slot]
        if expected > capacity or expected > staging.numel():
            raise PayloadError(
                f"update_info.nbytes: {expected} bytes do not fit slot {update_info.slot} "
                f"({capacity} bytes) or this worker's staging ({staging.numel()} bytes)"
            )
        if not buckets or not expected:
            if buckets:
                self.sink.load_weights(list(unpack_bucket(buckets[0], staging[:0])))
            return
        dest = self._in_place(init, buckets[0])
        if dest is not None:
            self._read(init, dest, remote, expected)
            self.in_place_bytes += expected
            return  # the sink's own tensor holds it; load_weights is not called for it
        self._read(init, staging, remote, expected)
        self.staged_bytes += expected
        self.sink.load_weights(list(unpack_bucket(buckets[0], staging[:expected])))

    def _read_regions(
        self, init: MooncakeInitInfo, bucket: Bucket, regions: list[Any], staging: torch.Tensor
    ) -> None:
        """Read ``bucket``'s tensors from their regions in one batch: into the sink's tensors
        where offered, else into staging, which the sink then loads."""
        local: list[int] = []
        remote: list[int] = []
        lengths: list[int] = []
        in_place = 0
        staged: set[str] = set()
        for m, off, (address, n) in zip(bucket.metas, bucket.offsets, regions, strict=True):
            dest = self._destination(m.name, m.dtype, m.shape) if n else None
            if dest is not None and dest.numel() == n:
                local.append(dest.data_ptr())
                in_place += n
            else:
                staged.add(m.name)  # an empty tensor too: loaded from no bytes
                if not n:
                    continue
                self._lend_or_fail(staging)
                local.append(staging.data_ptr() + off)
            remote.append(address)
            lengths.append(n)
        if lengths:
            call = BackgroundCall(
                self._engine.batch_transfer_sync_read, init.endpoint, local, remote, lengths,
                name="mooncake-read",
            )  # fmt: skip
            what = f"{len(lengths)} tensors ({sum(lengths)} bytes) from the trainer"
            self._wait_read(call, f"{what} at {init.endpoint}", init.timeout_s)
        self.in_place_bytes += in_place
        self.staged_bytes += sum(lengths) - in_place
        if staged:
            views = unpack_bucket(bucket, staging[: bucket.nbytes])
            self.sink.load_weights([(name, t) for name, t in views if name in staged])

    def _in_place(self, init: MooncakeInitInfo, bucket: Bucket) -> torch.Tensor | None:
        if not init.packed or init.direct_min_bytes <= 0 or len(bucket.metas) != 1:
            return None
        m = bucket.metas[0]
        if m.nbytes < init.direct_min_bytes:
            return None
        dest = self._destination(m.name, m.dtype, m.shape)
        if dest is None or dest.numel() != bucket.nbytes:  # checked: exactly its bytes
            return None
        return dest

    def _read(self, init: MooncakeInitInfo, into: Any, remote: int, n: int) -> None:
        self._lend_or_fail(into)
        call = BackgroundCall(
            self._engine.transfer_sync_read, init.endpoint, into.data_ptr(), remote, n,
            name="mooncake-read",
        )  # fmt: skip
        self._wait_read(call, f"{n} bytes from the trainer at {init.endpoint}", init.timeout_s)

    def _wait_read(self, call: BackgroundCall[Any], what: str, timeout_s: float) -> None:
        """Wait for ``call``, a read of ``what``; one that fails or stalls fails the round."""
        self._suspect = True  # until the round finishes
        if not call.wait(timeout_s):
            into, self._lent = list(self._lent.values()), {}  # registered until it ends
            ours = {id(self._staging), id(self._round_buf)}
            sinks = sum(id(t) not in ours for t in into)
            self._reading.append(_StaleRead(call, into, sinks, timeout_s))
            if any(t is self._staging for t in into):
                self._staging = None
            self._release()
            raise TransferTimeoutError(
                f"reading {what} took over {timeout_s:g} s; the round is failed"
            )
        rc = call.result(0)
        if rc != 0:
            self._release()
            raise TransferError(
                f"reading {what} failed (Mooncake status {rc}: the trainer is gone or "
                "stalled, or the region is not registered there)"
            )

    def _forget_ended_reads(self) -> None:
        running: list[_StaleRead] = []
        for r in self._reading:
            if not r.call.wait(0):
                running.append(r)
                continue
            for t in r.into:
                self._engine.unregister_memory(t.data_ptr())
        self._reading = running

    def _release(self) -> None:
        """Drop the staging and the round's buffer (a timed-out read's stays until it ends)."""
        self._forget_ended_reads()
        self._drop_round()
        self._staging = None
        if self._engine is not None:
            self._unlend()

    def shutdown(self) -> None:
        self._release()  # the transfer engine is the process's (te.start), and stays
        self._engine = None  # not held here any more: te.close may end it
        super().shutdown()
