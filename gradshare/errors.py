"""The one error hierarchy of gradshare.

    GradshareError
    ├── ProtocolError
    │   ├── LocalProtocolError      our own misuse of a protocol object (a bug or a bad call)
    │   └── RemoteProtocolError     bad input from the wire (also a ValueError)
    │       └── DecodeError         bytes that do not decode to a valid message
    ├── TransportTimeout            a peer or the relay did not answer in time (also a TimeoutError)
    ├── ConsistencyError            replicas diverged: parameter hashes differ at the end of a fit
    ├── TrainingError               a Spark task or the training job failed; says which and why
    └── CheckpointError             a checkpoint is incomplete, corrupt or truncated (also a ValueError)

Bad arguments from a caller raise plain ``ValueError``/``TypeError`` naming the argument.
"""

from __future__ import annotations


class GradshareError(Exception):
    """Root of every error gradshare raises on purpose.

    An error a worker raised carries, on the driver, the rank, the step it was in (None: before its
    first step) and the first cause of its chain as text; None on errors raised on the driver itself
    (reports.WorkerFailure sets them)."""

    rank: int | None = None
    step: int | None = None
    cause: str | None = None


class ProtocolError(GradshareError):
    """A protocol could not go on."""


class LocalProtocolError(ProtocolError):
    """We used a protocol object wrongly (sent after close, step out of order, ...)."""


class RemoteProtocolError(ProtocolError, ValueError):
    """Input from the network is malformed, forged, or out of bounds."""


class DecodeError(RemoteProtocolError):
    """Bytes do not decode to a valid message (raised by every ``from_bytes``/``decode_*``)."""


class TransportTimeout(GradshareError, TimeoutError):
    """A wait ran out. The message names what did not answer (address, peer, step)."""


class ConsistencyError(GradshareError):
    """Replicas that must be bit-identical are not."""


class TrainingError(GradshareError):
    """The training job failed; the message names the task/worker and the cause."""


class NonFiniteError(GradshareError, ValueError):
    """A value the encoder reads (residual, update, point) is NaN or ±inf; the message names its index."""


class MemoryLimitError(GradshareError, ValueError):
    """A worker cannot hold the model in the memory it is given: the message names the model's size, what a
    worker holds per parameter and the limit (driver/capacity.py)."""


class CheckpointError(GradshareError, ValueError):
    """A checkpoint cannot be loaded whole: no manifest, or a file that does not match it (checkpoint.py)."""


__all__ = [
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
