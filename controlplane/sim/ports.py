"""Free loopback ports for the servers the demo, the emulator provider, the tests and the
benchmarks start, safe when several of them run at once.

A port found by binding to 0 and closing lies in the kernel's ephemeral range, and until the
server told about it binds, the kernel may hand it out again: to another bind(0) in another
process, or as the source port of an outgoing connection, of which a demo's scrapes and a test
run make thousands. The server then fails to bind, in ways that look like anything but a port
clash (an Envoy whose admin cannot bind; an Envoy whose listener is rejected, so that the demo
waited a minute for a config that never took: a CI run).

So ports come from below the ephemeral range, where the kernel never picks one by itself, in
blocks of BLOCK ports. A process claims a block with an exclusive flock on a file in the temp
dir and holds it until it exits: no other process using this module gets a port of that block.
Within a process, a port is handed out once (until every block is used up, when the oldest
ones are handed out again, long after their tests ended), and only if it binds now.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
import threading
from pathlib import Path

BLOCK = 200
LOCK_DIR = Path(tempfile.gettempdir()) / "controlplane-ports"


def _span() -> tuple[int, int]:
    """[low, high): the ports below the kernel's ephemeral range (or above it, if it starts low)."""
    try:
        first, last = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        first, last = 32768, 60999
    if first - 10000 >= 20 * BLOCK:
        return 10000, first
    return last + 1, 65536


class _Allocator:
    def __init__(self) -> None:
        self.low, self.high = _span()
        self.blocks = (self.high - self.low) // BLOCK
        self.lock = threading.Lock()
        self.claimed: list[tuple[int, int]] = []  # (block, fd of its held lock file)
        self.block: int | None = None  # the block ports come from now
        self.next = 0  # the next port of it to try
        self.pid = os.getpid()

    def _claim(self) -> int | None:
        """Another block no process holds (this one included), or None if all are held."""
        LOCK_DIR.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            LOCK_DIR.chmod(0o1777)  # several users' runs may share the temp dir
        mine = {b for b, _ in self.claimed}
        start = os.getpid() % self.blocks  # spread processes out: fewer locks tried
        for i in range(self.blocks):
            b = (start + i) % self.blocks
            if b in mine:
                continue
            try:
                fd = os.open(LOCK_DIR / f"{b}.lock", os.O_CREAT | os.O_RDWR, 0o666)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.claimed.append((b, fd))
            return b
        return None

    def _reset_after_fork(self) -> None:
        # A forked child does not hold its parent's flocks' meaning: start afresh.
        self.claimed, self.block, self.next, self.pid = [], None, 0, os.getpid()

    def ports(self, n: int) -> int:
        """The first of n consecutive ports, each free now and not handed out before."""
        with self.lock:
            if self.pid != os.getpid():
                self._reset_after_fork()
            recycled = 0
            while True:
                if self.block is None or self.next + n > self.low + (self.block + 1) * BLOCK:
                    b = self._claim()
                    if b is None:  # every block is held: hand out this process's own again
                        if not self.claimed or recycled >= len(self.claimed):
                            raise RuntimeError(f"no {n} free loopback ports in {self.low}-{self.high}")
                        b = self.claimed[recycled][0]
                        recycled += 1
                    self.block, self.next = b, self.low + b * BLOCK
                base = self.next
                if all(_binds(p) for p in range(base, base + n)):
                    self.next = base + n
                    return base
                self.next = base + 1


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_ALLOCATOR = _Allocator()


def free_port() -> int:
    """A port free on 127.0.0.1 now, that no other process using this module is given and the
    kernel does not pick for anyone else."""
    return _ALLOCATOR.ports(1)


def free_ports(n: int) -> int:
    """The first of n consecutive such ports (for `controlplane emulate --count`)."""
    return _ALLOCATOR.ports(n)
