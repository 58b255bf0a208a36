"""Child processes of the demo and the emulator provider: they never outlive their parent."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that has the kernel send the child SIGTERM when the parent dies, however
    it dies (SIGKILL included), so no child outlives it. Linux only (prctl
    PR_SET_PDEATHSIG); elsewhere None, and the parent's own cleanup is all there is."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def set_pdeathsig() -> None:  # runs in the child between fork and exec: no Python locks
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above: go now
            os._exit(1)

    return set_pdeathsig
