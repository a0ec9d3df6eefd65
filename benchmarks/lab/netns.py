"""Commodity links for the benchmark: a private network namespace whose loopback is shaped with tbf.

    unshare --net [--map-root-user] -- sh -c 'ip link set lo up && tc qdisc add dev lo root tbf
        rate 1gbit burst 4mb latency 400ms && "$@"; rc=$?; tc qdisc del dev lo root; exit $rc' ...

(docs/design.md, "Measuring"; netem is not available on this kernel.) A fresh namespace has only `lo`, so
nothing inside it — Spark, Gloo, the relay — can reach any other address. The namespace vanishes with
its last process; the qdisc is deleted explicitly first. Every packet on `lo` passes the one qdisc
once, so the rate is shared by both directions of every connection (a half-duplex link of that rate).
Standard library only: the CLI imports this module's user to build its parser.
"""

from __future__ import annotations

import os
import shutil
import subprocess

# link name → tbf rate (None: not shaped). burst/latency as in docs/design.md.
LINKS: dict[str, str | None] = {"unshaped": None, "1gbit": "1gbit", "100mbit": "100mbit"}
BURST, LATENCY = "4mb", "400ms"


def namespace_prefix(is_root: bool) -> list[str]:
    """`unshare` arguments for a private network namespace; without root, a user namespace maps us
    to root inside it so that `ip`/`tc` may configure its loopback."""
    return ["unshare", "--net"] if is_root else ["unshare", "--net", "--map-root-user"]


def setup_script(rate: str | None) -> str:
    """Shell text run inside the namespace before the command ("$@")."""
    if rate is not None and rate not in LINKS.values():
        raise ValueError(f"rate must be one of {[r for r in LINKS.values() if r]} or None, got {rate!r}")
    up = "ip link set lo up"
    if rate is None:
        return f'{up} && "$@"'
    shape = f"tc qdisc add dev lo root tbf rate {rate} burst {BURST} latency {LATENCY}"
    return f'{up} && {shape} && {{ "$@"; rc=$?; tc qdisc del dev lo root; exit $rc; }}'


def wrap(command: list[str], link: str, is_root: bool | None = None) -> list[str]:
    """`command` run inside a fresh namespace with `link`'s shaping."""
    if link not in LINKS:
        raise ValueError(f"link must be one of {list(LINKS)}, got {link!r}")
    if not command:
        raise ValueError("command must not be empty")
    root = os.geteuid() == 0 if is_root is None else is_root
    return [*namespace_prefix(root), "--", "sh", "-c", setup_script(LINKS[link]), "gradshare-netns", *command]


def probe(timeout: float = 15.0) -> tuple[bool, str]:
    """Can we create a namespace and shape its loopback? (ok, what is missing if not)."""
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"missing tools: {', '.join(missing)} (util-linux, iproute2)"
    cmd = wrap(["true"], "1gbit")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"{' '.join(cmd[:4])} did not finish within {timeout:g} s"
    if p.returncode != 0:
        why = (p.stderr or p.stdout).strip().splitlines()
        hint = (
            "run as root, or enable unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0)"
        )
        return (
            False,
            f"`{' '.join(namespace_prefix(os.geteuid() == 0))}` + tc failed: "
            f"{why[-1] if why else 'exit ' + str(p.returncode)}; {hint}",
        )
    return True, "ok"


def interfaces() -> list[str]:
    """Network interfaces visible to this process (inside a fresh namespace: ['lo'])."""
    with open("/proc/net/dev") as f:
        return [line.split(":")[0].strip() for line in f.readlines()[2:] if ":" in line]
