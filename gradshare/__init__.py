"""gradshare: data-parallel PyTorch training on Spark with Strom threshold-encoded updates over UDP.

The public surface is re-exported here; everything else is internal.
"""

from gradshare.encoding import (
    AdaptiveThreshold,
    FixedThreshold,
    Message,
    ResidualClipping,
    TargetSparsityThreshold,
    apply,
    encode,
    residual_stats,
)
from gradshare.errors import (
    ConsistencyError,
    DecodeError,
    GradshareError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    TrainingError,
    TransportTimeout,
)
from gradshare.trainer import FitResult, SharedTrainer

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "SharedTrainer",
    "FitResult",
    "encode",
    "apply",
    "Message",
    "FixedThreshold",
    "AdaptiveThreshold",
    "TargetSparsityThreshold",
    "ResidualClipping",
    "residual_stats",
    "GradshareError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "DecodeError",
    "TransportTimeout",
    "ConsistencyError",
    "TrainingError",
]
