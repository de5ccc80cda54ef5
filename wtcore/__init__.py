"""wtcore: move freshly trained weights from RL trainers into inference workers.

``import wtcore`` imports neither torch nor any plugin: engines and clients load when used.
"""

from __future__ import annotations

from wtcore._version import __version__
from wtcore.buckets import Bucket, plan_buckets
from wtcore.client import InspectableClient, WeightSyncClient
from wtcore.config import build_client, load_config, trainer_from_config
from wtcore.defaults import DEFAULT_TIMEOUT_S
from wtcore.digest import tensor_digest
from wtcore.engine import WeightTransferConfig, WeightTransferEngine
from wtcore.errors import (
    PayloadError,
    PluginLoadError,
    ProtocolStateError,
    ReceiverError,
    ReceiverFailure,
    ReceiverTimeoutError,
    TransferError,
    TransferTimeoutError,
    VerificationError,
    WtcoreError,
)
from wtcore.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
from wtcore.meta import ParamMeta, materialize_full_tensor
from wtcore.registry import CLIENTS, ENGINES, TRAINER_ENGINES, Registry
from wtcore.sink import ModuleSink, ReadableSink, WeightSink
from wtcore.source import ModuleSource, TensorSource, WeightSource
from wtcore.stats import TransferStats
from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine
from wtcore.worker import WeightSyncWorker, WorkerState

__all__ = [
    "CLIENTS",
    "DEFAULT_TIMEOUT_S",
    "ENGINES",
    "TRAINER_ENGINES",
    "Bucket",
    "InspectableClient",
    "ModuleSink",
    "ModuleSource",
    "ParamMeta",
    "PayloadError",
    "PluginLoadError",
    "ProtocolStateError",
    "ReadableSink",
    "ReceiverError",
    "ReceiverFailure",
    "ReceiverTimeoutError",
    "Registry",
    "TensorSource",
    "TrainerInitInfo",
    "TrainerWeightTransferEngine",
    "TransferError",
    "TransferStats",
    "TransferTimeoutError",
    "VerificationError",
    "WeightSink",
    "WeightSource",
    "WeightSyncClient",
    "WeightSyncWorker",
    "WeightTransferConfig",
    "WeightTransferEngine",
    "WeightTransferEngineFactory",
    "WeightTransferTrainerFactory",
    "WorkerState",
    "WtcoreError",
    "__version__",
    "build_client",
    "load_config",
    "materialize_full_tensor",
    "plan_buckets",
    "tensor_digest",
    "trainer_from_config",
]
