"""The parameter hash: what "bit-identical replicas" is checked with (docs/design.md, Consistency).

Beside flat.py (the buffer it hashes), but free of torch: the transport's cores import it to check a
snapshot's digest, and they stay importable without torch.
"""

from __future__ import annotations

import hashlib

import numpy as np


def param_hash(array: np.ndarray) -> str:
    """Hash of a float32 parameter vector (blake2b-128 of its bytes): equal hashes = bit-identical."""
    a = np.asarray(array)
    if a.dtype != np.float32:
        raise ValueError(f"param_hash needs a float32 array (got {a.dtype})")
    # the ignore: numpy's stubs give ndarray its buffer protocol (__buffer__) for Python >= 3.12 only
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return hashlib.blake2b(flat, digest_size=16).hexdigest()  # type: ignore[arg-type]


__all__ = ["param_hash"]
