"""The lab's sweeps name every knob flat (``{"density": 1e-3, "bind": "127.0.0.1"}``): `in_groups` moves
each grouped option into SharedTrainer's group for it, which is what the trainer takes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gradshare.config.grouping import GROUPS, grouped

# each grouped option's name -> its group's keyword on SharedTrainer
GROUP_OF = {f.name: keyword for keyword, group in GROUPS.items() for f in dataclasses.fields(group) if f.init}


def in_groups(options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` with each grouped option named flat moved into its group (joining a group given there, as
    its dataclass or a dict) and each group made its dataclass."""
    out = dict(options)
    for name in [k for k in options if k in GROUP_OF]:
        keyword, value = GROUP_OF[name], out.pop(name)
        current = out.get(keyword)
        if isinstance(current, GROUPS[keyword]):
            out[keyword] = dataclasses.replace(current, **{name: value})
        else:
            out[keyword] = {**(current or {}), name: value}
    return grouped(out, "the lab's options")


__all__ = ["GROUP_OF", "in_groups"]
