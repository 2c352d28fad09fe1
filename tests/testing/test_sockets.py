"""LoopbackWatch: a child process tree listening on 127.0.0.1 passes; one bound to another address fails."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import psutil
import pytest

from verl_trainer.testing.sockets import LoopbackWatch

LISTEN = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)\n"
    "print('ready', flush=True); time.sleep(30)\n"
)


def _other_address() -> str | None:
    """An IPv4 address of this machine other than the loopback, if it has one."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _watch_listener(address: str) -> LoopbackWatch:
    # the listener runs in a grandchild: the watch must follow descendants
    cmd = [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {LISTEN!r}, "
                                 f"{address!r}])"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        watch = LoopbackWatch([proc.pid])
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while not watch.sockets_seen and not watch.wildcard_listeners and time.monotonic() < deadline:
            watch.sample()
            time.sleep(0.05)
        return watch
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()


def test_loopback_listener_passes():
    watch = _watch_listener("127.0.0.1")
    watch.check()
    assert len(watch.pids_seen) == 2


def test_wildcard_listener_is_recorded_not_offending():
    watch = _watch_listener("0.0.0.0")
    assert [s.local for s in watch.wildcard_listeners] == ["0.0.0.0"] and not watch.offending


def test_listener_on_another_address_fails():
    address = _other_address()
    if address is None:
        pytest.skip("this machine has no address but the loopback")
    watch = _watch_listener(address)
    with pytest.raises(AssertionError, match=rf"sockets outside 127.0.0.1:\n.*{address} -> - \[LISTEN\]"):
        watch.check()


def test_a_watch_that_saw_nothing_fails():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    watch = LoopbackWatch([proc.pid])
    watch.sample()
    with pytest.raises(AssertionError, match="no socket seen"):
        watch.check()


UDP = (
    "import socket, sys, time\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect((sys.argv[1], int(sys.argv[2])))\n"
    "print('ready', flush=True); time.sleep(30)\n"
)


def _watch_udp(address: str, port: int, resolvers: frozenset[str]) -> LoopbackWatch:
    """A child with a UDP socket connected to ``address:port`` (a UDP connect sends nothing)."""
    proc = subprocess.Popen([sys.executable, "-c", UDP, address, str(port)], stdout=subprocess.PIPE,
                            text=True)
    try:
        watch = LoopbackWatch([proc.pid], resolvers=resolvers)
        assert proc.stdout.readline().strip() == "ready"
        watch.sample()
        return watch
    finally:
        proc.kill()
        proc.wait()


def test_a_lookup_at_a_nameserver_is_recorded_not_offending_and_other_udp_is():
    resolver = "192.0.2.53"  # TEST-NET-1: never a real host
    lookup = _watch_udp(resolver, 53, frozenset({resolver}))
    assert [s.remote for s in lookup.dns_lookups] == [resolver] and not lookup.offending
    other_port = _watch_udp(resolver, 80, frozenset({resolver}))
    with pytest.raises(AssertionError, match=rf"-> {resolver} "):
        other_port.check()
    not_a_resolver = _watch_udp(resolver, 53, frozenset())
    assert not_a_resolver.offending and not not_a_resolver.dns_lookups
