"""Proof that a multi-process test stays on the loopback interface: the sockets of a process tree.

Multi-node tests (simulated nodes on one machine: torchrun agents, SLURM tasks, a local Ray cluster) must
not listen on, or connect to, any address but 127.0.0.1. :class:`LoopbackWatch` samples the inet sockets
of the given processes and all their descendants while they run (processes come and go, so one look at
the end is not enough) and :meth:`LoopbackWatch.check` fails with every offending socket: one bound to,
or connected to, an address other than the loopback.

A socket listening on the wildcard address (``0.0.0.0`` / ``::``) is recorded in
:attr:`LoopbackWatch.wildcard_listeners` but allowed: torch's ``TCPStore`` server (the rendezvous store of
``init_process_group(init_method="env://")``, of torchrun's agent and of Ray's ``TorchTrainer``) always
listens on every interface, and torch has no option to bind it to one address. Every connection such a
listener accepts is still checked, so a run that passes talked over 127.0.0.1 only.

A UDP socket connected to one of the system's nameservers (``/etc/resolv.conf``) on port 53 is a host-name
lookup by the C resolver (a Ray worker resolving its host name, seen once in CI), not a socket the test's
code bound: it is recorded in :attr:`LoopbackWatch.dns_lookups` and allowed.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

import psutil

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
"""Addresses a test process may bind or connect to."""
WILDCARD = ("0.0.0.0", "::")
"""The any-address: allowed for a listening socket only (see the module docstring)."""


def nameservers(resolv_conf: str = "/etc/resolv.conf") -> frozenset[str]:
    """The ``nameserver`` addresses of ``resolv_conf`` (empty when it cannot be read)."""
    try:
        lines = Path(resolv_conf).read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(parts[1] for parts in (line.split() for line in lines)
                     if len(parts) >= 2 and parts[0] == "nameserver")


@dataclass(frozen=True)
class SocketUse:
    """One inet socket of a process: its pid and command, local and remote address (``""``: none)."""

    pid: int
    name: str
    local: str
    remote: str
    status: str


def _addresses(conn: psutil._common.pconn) -> tuple[str, str]:
    local = conn.laddr.ip if conn.laddr else ""
    remote = conn.raddr.ip if conn.raddr else ""
    return local, remote


@dataclass
class LoopbackWatch:
    """Samples the inet sockets of ``roots`` and their descendants; remembers every non-loopback one.

    Args:
        roots: Pids of the processes whose trees are watched.
        pids_seen: Every pid observed so far (roots and descendants).
        offending: Sockets bound or connected to an address outside :data:`LOOPBACK`.
        wildcard_listeners: Listening sockets bound to :data:`WILDCARD` (allowed, recorded).
        dns_lookups: UDP sockets to a nameserver's port 53 (allowed, recorded; module docstring).
        sockets_seen: How many distinct sockets were inspected (a watch that saw none proves nothing).
    """

    roots: list[int]
    pids_seen: set[int] = field(default_factory=set)
    offending: list[SocketUse] = field(default_factory=list)
    wildcard_listeners: list[SocketUse] = field(default_factory=list)
    dns_lookups: list[SocketUse] = field(default_factory=list)
    resolvers: frozenset[str] = field(default_factory=nameservers)
    sockets_seen: set[tuple[int, str, str, str]] = field(default_factory=set)

    def processes(self) -> list[psutil.Process]:
        """The roots still running and all their descendants."""
        procs = []
        for pid in self.roots:
            try:
                root = psutil.Process(pid)
                procs += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        return procs

    def sample(self) -> None:
        """Look once at every socket of the watched processes."""
        for proc in self.processes():
            try:
                conns = proc.net_connections(kind="inet")
                name = proc.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            self.pids_seen.add(proc.pid)
            for conn in conns:
                local, remote = _addresses(conn)
                key = (proc.pid, local, remote, conn.status)
                if key in self.sockets_seen:
                    continue
                self.sockets_seen.add(key)
                use = SocketUse(proc.pid, name, local, remote, conn.status)
                if local in WILDCARD and not remote and conn.status == psutil.CONN_LISTEN:
                    self.wildcard_listeners.append(use)
                    continue
                if (conn.type == socket.SOCK_DGRAM and remote in self.resolvers and conn.raddr
                        and conn.raddr.port == 53):
                    self.dns_lookups.append(use)
                    continue
                bad_local = local not in LOOPBACK and local != ""
                bad_remote = remote not in LOOPBACK and remote != ""
                if bad_local or bad_remote:
                    self.offending.append(use)

    def check(self) -> None:
        """Raise if any sampled socket used another address, or if no socket was seen at all.

        Raises:
            AssertionError: Listing each offending socket (pid, command, local -> remote, status).
        """
        assert self.sockets_seen, f"no socket seen in processes {sorted(self.pids_seen)}: nothing was checked"
        lines = [f"pid {s.pid} ({s.name}): {s.local or '-'} -> {s.remote or '-'} [{s.status}]"
                 for s in self.offending]
        assert not lines, "sockets outside 127.0.0.1:\n" + "\n".join(lines)
