"""wtcore-channel: the kit of streamed engines, which announce a round once and stream its bytes.

An engine (``nccl``, ``tcp``) supplies its :class:`~wtcore_channel.pipeline.Channel`; this kit
runs the round on it (docs/architecture.md, "Extension points"). Importing it imports no torch.
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
