"""Threshold encoding (Strom 2015): fused accumulate+encode kernels, message forms, thresholds.

m = encode(residual, update, threshold)   # residual updated in place
data = m.to_bytes()
m2 = Message.from_bytes(data, max_params=n)
apply(m2, params, scale=1.0)
"""

from gradshare.encoding.codec import apply, convert, decode, decode_entries, encode
from gradshare.encoding.message import BITMAP, EMPTY, FORMS, RICE, SPARSE, Message
from gradshare.encoding.sharing import SharingState, share_step, skipped_step
from gradshare.encoding.stats import residual_stats
from gradshare.encoding.threshold import (
    AdaptiveThreshold,
    CalibratedThreshold,
    FixedThreshold,
    ResidualClipping,
    TargetSparsityThreshold,
    encode_step,
)
from gradshare.encoding.update import StepUpdate, apply_update, buffer_change, decode_update

__all__ = [
    "encode",
    "apply",
    "decode",
    "decode_entries",
    "convert",
    "Message",
    "FORMS",
    "EMPTY",
    "SPARSE",
    "RICE",
    "BITMAP",
    "FixedThreshold",
    "AdaptiveThreshold",
    "CalibratedThreshold",
    "TargetSparsityThreshold",
    "ResidualClipping",
    "encode_step",
    "SharingState",
    "share_step",
    "skipped_step",
    "residual_stats",
    "StepUpdate",
    "apply_update",
    "buffer_change",
    "decode_update",
]
