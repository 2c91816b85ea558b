"""Several hosts on one machine: network namespaces on one bridge, made and removed by the
test that uses them (needs root and iproute2; iptables for partitions).

Every address is inside namespaces this module creates (``SUBNET.1`` .. ``SUBNET.n``); no
traffic leaves them. Faults are injected the way a real network fails: a link taken down
(a host that lost power), iptables DROP (a silent partition) or REJECT (a refused
connection), inside the namespace of the host concerned.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

SUBNET = "10.213.77"


def sh(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")


class Hosts:
    """``n`` namespaces ``names[i]``, each with one interface ``interface(i)`` whose address
    is ``address(i)``, all on one bridge."""

    def __init__(self, tag: str, n: int) -> None:
        self.names = [f"trr{tag}{i}" for i in range(n)]
        self._tag = tag
        self._bridge = f"trrbr{tag}"
        self._created: list[tuple[str, str]] = []

    def address(self, index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def interface(self, index: int) -> str:
        # Unique on the host (the peer end is created outside the namespace, then moved in).
        return f"trp{self._tag}{index}"

    def _outside(self, index: int) -> str:
        return f"trv{self._tag}{index}"

    def create(self) -> None:
        if shutil.which("ip") is None:
            raise RuntimeError("iproute2's 'ip' command is missing")
        sh("ip", "link", "add", self._bridge, "type", "bridge")
        self._created.append(("link", self._bridge))
        sh("ip", "link", "set", self._bridge, "up")
        for index, name in enumerate(self.names):
            sh("ip", "netns", "add", name)
            self._created.append(("netns", name))
            outside, inside = self._outside(index), self.interface(index)
            sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            self._created.append(("link", outside))
            sh("ip", "link", "set", inside, "netns", name)
            sh("ip", "link", "set", outside, "master", self._bridge, "up")
            sh("ip", "-n", name, "addr", "add", f"{self.address(index)}/24", "dev", inside)
            sh("ip", "-n", name, "link", "set", inside, "up")
            sh("ip", "-n", name, "link", "set", "lo", "up")

    def remove(self) -> None:
        for kind, name in reversed(self._created):
            if kind == "netns":
                subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
        self._created.clear()

    # -- running things inside --------------------------------------------------------------

    def popen(
        self, index: int, argv: Sequence[str], env: Mapping[str, str], **kwargs: object
    ) -> subprocess.Popen[str]:
        """Start ``argv`` inside host ``index``. The command is exec'ed by ``ip netns exec``,
        so the Popen's pid is the program's own (signals reach it directly)."""
        return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
            ["ip", "netns", "exec", self.names[index], *argv], env=dict(env), text=True, **kwargs
        )

    def python(
        self, index: int, script: str, env: Mapping[str, str], **kwargs: object
    ) -> subprocess.Popen[str]:
        return self.popen(index, [sys.executable, script], env, **kwargs)

    # -- faults ------------------------------------------------------------------------------

    def link_down(self, index: int) -> None:
        """Host ``index`` drops off the network (its cable pulled, or its power)."""
        sh("ip", "-n", self.names[index], "link", "set", self.interface(index), "down")

    def iptables(self, index: int, *rule: str) -> None:
        """Add an iptables rule inside host ``index``, e.g. ``("-A", "INPUT", "-j", "DROP")``."""
        if shutil.which("iptables") is None:
            raise RuntimeError("the 'iptables' command is missing (Debian package iptables)")
        sh("ip", "netns", "exec", self.names[index], "iptables", *rule)

    def partition(self, index: int) -> None:
        """Host ``index`` silently loses every packet, both ways."""
        self.iptables(index, "-A", "INPUT", "-j", "DROP")
        self.iptables(index, "-A", "OUTPUT", "-j", "DROP")


@contextlib.contextmanager
def open_hosts(n: int) -> Iterator[Hosts]:
    """``n`` fresh hosts, removed again on exit; fails the test (does not skip it) when they
    cannot be made."""
    hosts = Hosts(f"{os.getpid() % 100000}", n)
    try:
        hosts.create()
    except (RuntimeError, OSError) as exc:
        hosts.remove()
        pytest.fail(f"cannot create network namespaces (needs root and iproute2): {exc}")
    try:
        yield hosts
    finally:
        hosts.remove()
