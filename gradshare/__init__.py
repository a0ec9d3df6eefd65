"""gradshare: data-parallel PyTorch training on Spark with Strom threshold-encoded updates over UDP.

The public surface is re-exported here; everything else is internal.
"""

from importlib import import_module as _import_module
from typing import TYPE_CHECKING

from gradshare.errors import (
    CheckpointError,
    ConsistencyError,
    DecodeError,
    GradshareError,
    LocalProtocolError,
    MemoryLimitError,
    NonFiniteError,
    ProtocolError,
    RemoteProtocolError,
    TrainingError,
    TransportTimeout,
)

if TYPE_CHECKING:  # "X as X": the lazy names re-exported, for type checkers (PEP 484)
    from gradshare.config.options import Compression as Compression
    from gradshare.config.options import Elastic as Elastic
    from gradshare.config.options import FaultTolerance as FaultTolerance
    from gradshare.config.options import Network as Network
    from gradshare.config.options import Runtime as Runtime
    from gradshare.driver.result import FitResult as FitResult
    from gradshare.driver.trainer import SharedTrainer as SharedTrainer
    from gradshare.encoding import AdaptiveThreshold as AdaptiveThreshold
    from gradshare.encoding import CalibratedThreshold as CalibratedThreshold
    from gradshare.encoding import FixedThreshold as FixedThreshold
    from gradshare.encoding import Message as Message
    from gradshare.encoding import ResidualClipping as ResidualClipping
    from gradshare.encoding import TargetSparsityThreshold as TargetSparsityThreshold
    from gradshare.encoding import apply as apply
    from gradshare.encoding import encode as encode
    from gradshare.encoding import residual_stats as residual_stats
    from gradshare.replica.losses import clip_grad_norm as clip_grad_norm

__version__ = "0.1.0"

# The one lazy seam of the public surface: these names load on first use (PEP 562), so
# importing gradshare (the CLI's `--help`, gradshare.errors on an executor) pays neither NumPy + Numba
# (~0.5 s, the encoding names) nor torch + pyspark + Numba (~2 s, the trainer's).
_ENCODING_NAMES = (
    "encode",
    "apply",
    "Message",
    "FixedThreshold",
    "AdaptiveThreshold",
    "CalibratedThreshold",
    "TargetSparsityThreshold",
    "ResidualClipping",
    "residual_stats",
)
_TRAINER_NAMES = ("SharedTrainer", "FitResult", "clip_grad_norm")
# SharedTrainer's option groups (gradshare/config/options.py): light, but loaded lazily like the rest
_OPTION_NAMES = ("Compression", "Network", "FaultTolerance", "Runtime", "Elastic")
_LAZY = {
    **dict.fromkeys(_ENCODING_NAMES, "gradshare.encoding"),
    "SharedTrainer": "gradshare.driver.trainer",
    "FitResult": "gradshare.driver.result",
    "clip_grad_norm": "gradshare.replica.losses",
    **dict.fromkeys(_OPTION_NAMES, "gradshare.config.options"),
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(_import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gradshare' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    *_TRAINER_NAMES,
    *_OPTION_NAMES,
    *_ENCODING_NAMES,
    "GradshareError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "DecodeError",
    "TransportTimeout",
    "ConsistencyError",
    "TrainingError",
    "CheckpointError",
    "MemoryLimitError",
    "NonFiniteError",
]
