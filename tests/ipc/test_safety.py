"""No pickle, no arbitrary files: what a payload can and cannot make the worker touch."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch

from wtcore import PayloadError, TransferError, WeightSyncWorker
from wtcore.sink import ModuleSink
from wtcore.testing import build_module
from wtcore_ipc.shm import (
    _MAGIC,
    HEADER_BYTES,
    SEALS,
    SegmentReader,
    StagingSegment,
    check_segment_fd,
    check_segment_name,
)
from wtcore_ipc.worker import slot_ready

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "ipc" / "wtcore_ipc"
FORBIDDEN = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}


def test_no_module_of_the_plugin_imports_pickle() -> None:
    files = sorted(PLUGIN.rglob("*.py"))
    assert len(files) >= 5
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for m in mods:
                assert m.split(".")[0] not in FORBIDDEN, f"{f.name} imports {m}"
                assert "reduction" not in m, f"{f.name} imports {m} (pickle-based)"


@pytest.mark.parametrize(
    "name",
    [
        "../etc/passwd",
        "wtcore_a/b",
        "wtcore_abc\n",
        "other_prefix",
        "wtcore_",
        "wtcore_a.b",
        "",
        7,
        "wtcore_ipc_12_0123456789abcdef\n",
        "wtcore_ipc_0_0123456789abcdef",  # pid 0
        "wtcore_ipc_9999999_0123456789abcdef",  # beyond Linux's largest pid
        "wtcore_ipc_12_0123456789ABCDEF",  # the token is lowercase hex
        "wtcore_ipc_12_0123456789abcde",  # too short
        "wtcore_ipc_12_../../etc/passwd",
    ],
)
def test_segment_names_are_validated(name: object) -> None:
    with pytest.raises(PayloadError, match="segment: expected a segment name"):
        check_segment_name(name)


@pytest.mark.parametrize("fd", [-1, 1 << 31, True, 3.0, "3", None])
def test_segment_fds_are_validated(fd: object) -> None:
    with pytest.raises(PayloadError, match="segment_fd: expected a descriptor number"):
        check_segment_fd(fd)


def test_a_segment_is_a_sealed_memfd_outside_dev_shm() -> None:
    """Sealed before anyone can learn of it: shrink, grow and seal are refused by the kernel,
    and nothing appears in /dev/shm."""
    import fcntl

    seg = StagingSegment(4096, 2)
    try:
        assert seg.fd is not None
        assert fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        assert os.readlink(seg.path) == f"/memfd:{seg.name} (deleted)"
        assert os.stat(seg.path).st_mode & 0o777 == 0o600
        assert not [n for n in os.listdir("/dev/shm") if seg.name in n]
        for length in (0, seg.size - 8, seg.size + 8):
            with pytest.raises(PermissionError):
                os.ftruncate(seg.fd, length)
    finally:
        seg.close()


def test_segment_lifecycle_and_orphan_detection() -> None:
    seg = StagingSegment(1000, 2)
    path = Path(seg.path)
    try:
        assert path.exists() and seg.capacity >= 1000 and seg.num_slots == 2
        seg.slot(1)[:5].copy_(torch.arange(5, dtype=torch.uint8))
        seg.publish(1, seq=9, length=5)
        assert seg.fd is not None
        reader = SegmentReader(seg.name, seg.fd)
        try:
            assert reader.owner_alive(), "the trainer's lock is held"
            head = reader.header(seg.data_offset(1))
            assert head.valid and head.seq == 9 and head.length == 5
            assert torch.equal(
                reader.view(seg.data_offset(1), 5), torch.arange(5, dtype=torch.uint8)
            )
            seg.close()
            assert not path.exists() or os.readlink(path) != f"/memfd:{seg.name} (deleted)"
            assert not reader.owner_alive(), "closing released the lock"
            assert reader.close_if_orphaned() and reader.closed
        finally:
            reader.close()
    finally:
        seg.close()
    seg.close()  # idempotent


@pytest.mark.parametrize("reused", [False, True], ids=["fresh_slot", "reused_slot"])
def test_a_header_caught_mid_stamp_reads_as_not_yet(reused: bool) -> None:
    """The trainer stamps magic, then length, then the sequence number (the commit word); the
    worker reads the sequence number first. Until the commit, whatever mix of old and new magic
    and length the worker catches must read as "not yet", never as a forged header (a worker
    of a fresh trainer once refused a blank slot whose length had landed before its magic)."""
    seg = StagingSegment(1000, 1)
    try:
        old_seq, seq, length = (4, 5, 700) if reused else (0, 1, 700)
        if reused:
            seg.publish(0, old_seq, 300)
        at = seg.data_offset(0) - HEADER_BYTES
        old_magic, old_length = bytes(seg._mm[at : at + 8]), 300 if reused else 0
        assert seg.fd is not None
        reader = SegmentReader(seg.name, seg.fd)
        try:
            for magic in (old_magic, _MAGIC):
                for n in (old_length, length):
                    seg._mm[at : at + 8] = magic
                    seg._words[at + 16] = n
                    head = reader.header(seg.data_offset(0))
                    assert head.seq == old_seq
                    assert slot_ready(head, seq, length, where="s", bucket=0) is False, (magic, n)
            seg.publish(0, seq, length)  # the commit
            assert slot_ready(reader.header(seg.data_offset(0)), seq, length, where="s", bucket=0)
            seg._mm[at : at + 8] = b"EVILEVIL"  # a committed header is judged: forged magic
            with pytest.raises(PayloadError, match="no valid magic"):
                slot_ready(reader.header(seg.data_offset(0)), seq, length, where="s", bucket=0)
        finally:
            reader.close()
    finally:
        seg.close()


def test_update_info_must_name_one_transport() -> None:
    state = {"a": torch.zeros(3)}
    worker = WeightSyncWorker("ipc", ModuleSink(build_module(state)))
    try:
        worker.init_weight_transfer_engine(
            {
                "transport": "shm",
                "packed": True,
                "packed_buffer_size_bytes": 1024,
                "packed_num_buffers": 2,
            }
        )
        worker.start_weight_update()
        base = {
            "names": ["a"],
            "dtype_names": ["float32"],
            "shapes": [[3]],
            "sizes": [12],
            "offset": 64,
            "length": 12,
            "seq": 1,
        }
        with pytest.raises(PayloadError, match="exactly one of 'segment'"):
            worker.update_weights(base)
        with pytest.raises(PayloadError, match="init_info.transport: 'cuda' needs a CUDA"):
            worker.init_weight_transfer_engine(
                {
                    "transport": "cuda",
                    "packed": True,
                    "packed_buffer_size_bytes": 1024,
                    "packed_num_buffers": 2,
                }
            )
        json.dumps(base)
    finally:
        worker.shutdown()


def test_a_reader_closed_under_a_read_never_reads_another_files_bytes() -> None:
    """A worker's init (or shutdown) closes its segment reader while an abandoned round's
    thread may still read from it. When reads went through the descriptor, its number could be
    reused at once by another ``open`` of this process, and the read would copy that file's
    bytes, or fail with EBADF inside the init (seen once in CI, in the ipc contract suite's
    recovery case); through the mapping, a read after the unmap would crash the process.
    Every read must instead either complete with the segment's bytes or fail as "closed";
    300 close/reopen races, bounded in time."""
    import tempfile
    import time

    seg = StagingSegment(1 << 20, 1)
    try:
        with tempfile.TemporaryFile() as other:  # other bytes, opened while the reads run
            seg.slot(0)[: 1 << 20].fill_(7)
            other.write(bytes([9]) * (2 << 20))
            other.flush()
            deadline = time.monotonic() + 60
            for _ in range(300):
                if time.monotonic() > deadline:
                    break
                assert seg.fd is not None
                reader = SegmentReader(seg.name, seg.fd)
                errors = _race_close(reader, seg.data_offset(0), other.fileno())
                reader.close()  # idempotent
                assert errors == [], errors
    finally:
        seg.close()


def _race_close(reader: SegmentReader, offset: int, other_fd: int) -> list[BaseException]:
    """Reads of the 7-filled slot on a thread while this one closes the reader and takes the
    freed descriptor numbers for ``other_fd``'s file; what went wrong in the reads."""
    import os
    import threading

    out = torch.zeros(1 << 20, dtype=torch.uint8)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(20):
                reader.read_into(offset, out)
                assert int(out.min()) == int(out.max()) == 7, "another file's bytes"
        except TransferError as e:
            if "closed" not in str(e):
                errors.append(e)
        except BaseException as e:  # EBADF, or the wrong bytes
            errors.append(e)

    t = threading.Thread(target=read)
    t.start()
    reader.close()
    fds = [os.dup(other_fd) for _ in range(4)]
    t.join(30)
    for fd in fds:
        os.close(fd)
    assert not t.is_alive()
    return errors
