"""SharedTrainer's keyword for each option group (`GROUPS`) and the group of each grouped option's flat name
(`GROUP_OF`); options given as dicts (JSON, e.g. the Estimator's trainerOptions) made their groups, and the
flat names moved into their groups: with a DeprecationWarning for a user (`grouped`), silently for the
benchmarks' sweeps, which name every knob flat (`in_groups`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from gradshare.config.options import Compression, FaultTolerance, Network, Runtime

# SharedTrainer's keyword for each group, in the signature's order
GROUPS: dict[str, type[Compression | Network | FaultTolerance | Runtime]] = {
    "compression": Compression,
    "network": Network,
    "fault_tolerance": FaultTolerance,
    "runtime": Runtime,
}
# each grouped option's flat name (the deprecated SharedTrainer(density=...)) -> its group's keyword
GROUP_OF = {f.name: keyword for keyword, group in GROUPS.items() for f in dataclasses.fields(group) if f.init}


def grouped(options: Mapping[str, Any], caller: str = "SharedTrainer") -> dict[str, Any]:
    """`options` with each group given as a dict (JSON, e.g. the Estimator's trainerOptions) made its
    dataclass, and each deprecated flat name (``density=1e-3``) moved into its group with a
    DeprecationWarning. An option given flat and set otherwise in its group as well is an error naming it."""
    for keyword, names in _flat_names(options).items():
        given = ", ".join(f"{k}={options[k]!r}" for k in names)
        warnings.warn(
            f"{caller}({', '.join(f'{k}=' for k in names)}) is deprecated and will be removed in the "
            f"next release; pass {keyword}={GROUPS[keyword].__name__}({given})",
            DeprecationWarning,
            stacklevel=3,
        )
        current, default = options.get(keyword), GROUPS[keyword]()
        both = [
            k
            for k in names
            if isinstance(current, GROUPS[keyword])
            and getattr(current, k) != getattr(default, k)
            and getattr(current, k) != options[k]
        ]
        if both:
            raise ValueError(
                f"{caller}: {', '.join(both)} given both flat and in {keyword}=... with other "
                f"values; give them in {keyword}={GROUPS[keyword].__name__}(...) only"
            )
    return in_groups(options, caller)


def in_groups(options: Mapping[str, Any], caller: str = "SharedTrainer") -> dict[str, Any]:
    """`options` with each group given as a dict made its dataclass and each grouped option's flat name
    moved into its group, silently: the benchmarks' hook, whose sweeps name every knob flat."""
    out = dict(options)
    for keyword, names in _flat_names(options).items():
        flat, current = {k: out.pop(k) for k in names}, out.get(keyword)
        out[keyword] = (
            dataclasses.replace(current, **flat)
            if isinstance(current, GROUPS[keyword])
            else {**(current or {}), **flat}
        )
    for keyword, group in GROUPS.items():
        if isinstance(out.get(keyword), Mapping):
            out[keyword] = _group_from(group, keyword, out[keyword], caller)
    return out


def _flat_names(options: Mapping[str, Any]) -> dict[str, list[str]]:
    """The grouped options `options` names flat, by their group's keyword."""
    found: dict[str, list[str]] = {}
    for name in options:
        if name in GROUP_OF:
            found.setdefault(GROUP_OF[name], []).append(name)
    return found


def _group_from(group: type[Any], keyword: str, values: Mapping[str, Any], caller: str) -> Any:
    names = {f.name for f in dataclasses.fields(group) if f.init}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{caller}: {keyword} has no option(s) {unknown}; {group.__name__}'s are {sorted(names)}")
    return group(**values)


__all__ = ["GROUPS", "GROUP_OF", "grouped", "in_groups"]
