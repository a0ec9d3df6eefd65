"""The message forms, one per module, and the one table that names them: `BY_TAG`, keyed by the wire's
form byte (message.py). A form is a small frozen object behind the `Form` interface (base.py): its size
for measured codes, encode, validate, decode and apply. The codec picks the smallest (`smallest`).

    empty.py   no entries, no payload
    sparse.py  LEB128 varint gaps, sign in bit 0
    rice.py    Golomb-Rice coded gaps (and `measure`, the one pass that sizes the sparse and rice forms)
    bitmap.py  2 bits per parameter
"""

from __future__ import annotations

from collections.abc import Mapping

from gradshare.encoding.forms.base import APPLY_BATCH, CodeSizes, Form
from gradshare.encoding.forms.bitmap import BITMAP, bitmap_size
from gradshare.encoding.forms.empty import EMPTY
from gradshare.encoding.forms.rice import RICE, measure
from gradshare.encoding.forms.sparse import SPARSE

# the preference order too, when two forms are the same size
ORDER: tuple[Form, ...] = (EMPTY, SPARSE, RICE, BITMAP)
BY_TAG: Mapping[int, Form] = {form.tag: form for form in ORDER}
BY_NAME: Mapping[str, Form] = {form.name: form for form in ORDER}
NAMES = tuple(form.name for form in ORDER)


def named(name: object) -> Form:
    """The form called ``name`` (ValueError naming the known ones)."""
    form = BY_NAME.get(name) if isinstance(name, str) else None
    if form is None:
        raise ValueError(f"form must be one of {NAMES}, got {name!r}")
    return form


def smallest(sizes: CodeSizes) -> Form:
    """The form of the fewest payload bytes for the measured entries (ties by ORDER)."""
    fits = [(size, i, form) for i, form in enumerate(ORDER) if (size := form.size(sizes)) is not None]
    return min(fits, key=lambda fit: (fit[0], fit[1]))[2]


__all__ = [
    "APPLY_BATCH",
    "BY_NAME",
    "BY_TAG",
    "BITMAP",
    "EMPTY",
    "NAMES",
    "ORDER",
    "RICE",
    "SPARSE",
    "CodeSizes",
    "Form",
    "bitmap_size",
    "measure",
    "named",
    "smallest",
]
