"""SharedTrainer's keyword for each option group (`GROUPS`), and options whose groups are given as dicts
(JSON, e.g. the Estimator's trainerOptions) with each made its group's dataclass (`grouped`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from gradshare.config.options import Compression, FaultTolerance, Network, Runtime

# SharedTrainer's keyword for each group, in the signature's order
GROUPS: dict[str, type[Compression | Network | FaultTolerance | Runtime]] = {
    "compression": Compression,
    "network": Network,
    "fault_tolerance": FaultTolerance,
    "runtime": Runtime,
}


def grouped(options: Mapping[str, Any], caller: str = "SharedTrainer") -> dict[str, Any]:
    """`options` with each group given as a dict made its dataclass (an option the group does not have is
    an error naming it and the group's options)."""
    out = dict(options)
    for keyword, group in GROUPS.items():
        values = out.get(keyword)
        if isinstance(values, Mapping):
            names = {f.name for f in fields(group) if f.init}
            unknown = sorted(set(values) - names)
            if unknown:
                raise ValueError(
                    f"{caller}: {keyword} has no option(s) {unknown}; {group.__name__}'s are {sorted(names)}"
                )
            out[keyword] = group(**values)
    return out


__all__ = ["GROUPS", "grouped"]
