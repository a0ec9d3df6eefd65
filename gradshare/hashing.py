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
    # .data is memoryview(array) (no copy): numpy's stubs give ndarray the buffer protocol on Python >= 3.12 only
    return hashlib.blake2b(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data, digest_size=16).hexdigest()


__all__ = ["param_hash"]
