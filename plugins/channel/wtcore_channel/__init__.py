"""wtcore-channel: the kit of streamed engines, which announce a round once and stream its bytes.

``nccl`` (a process group) and ``tcp`` (TCP streams) are built on it, and so can be any engine
whose data plane moves messages by itself. The engine supplies its channel
(:class:`~wtcore_channel.pipeline.Channel`: one call to send a message or post its receive,
returning work that completes asynchronously); this kit runs the round on it:

* :mod:`wtcore_channel.options`: the shared options (``direct_min_bytes``, ``checksum``, the
  kit's bucket options) and the plan both ends compute;
* :mod:`wtcore_channel.sender` / :mod:`wtcore_channel.receiver`: the two halves of a round,
  pipelined, with every failure path (bounded drains, the sender's abort notice, a receive
  of an abandoned round settled before the next round writes);
* :mod:`wtcore_channel.frames`: frame headers, sizes (and CRCs) before bytes;
* :mod:`wtcore_channel.parts`: a packed bucket as its tensors, for a channel that takes a
  message in parts (no packing copy on either end);
* :mod:`wtcore_channel.pipeline`: the channel protocol, work in flight, reused buffers,
  bounded waits;
* :mod:`wtcore_channel.listen`: a sender's listening socket, on one address only.

It is a distribution of its own so that the core stays the protocol: only streamed engines
need it. Importing it does not import torch.
"""

from __future__ import annotations

from wtcore_channel.options import (
    DEFAULT_BUFFER_SIZE,
    DEFAULT_DIRECT_MIN_BYTES,
    ChannelSettings,
    ChannelTrainerInitInfo,
    ChannelUpdateInfo,
    check_direct,
    check_receiver_settings,
)
from wtcore_channel.pipeline import BufferPool, Channel, ThreadWork, Work, wait_work
from wtcore_channel.receiver import ChannelWorkerEngine
from wtcore_channel.sender import ChannelTrainerEngine

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "DEFAULT_DIRECT_MIN_BYTES",
    "BufferPool",
    "Channel",
    "ChannelSettings",
    "ChannelTrainerEngine",
    "ChannelTrainerInitInfo",
    "ChannelUpdateInfo",
    "ChannelWorkerEngine",
    "ThreadWork",
    "Work",
    "check_direct",
    "check_receiver_settings",
    "wait_work",
]
