"""Log an outage once, not once per failed attempt: the first failure of a dependency (etcd,
Redis, a peer, the operator API), then the recovery after it, then the next outage again.

A loop that retries every interval would otherwise write the same warning for as long as
the outage lasts, and one that forgets to re-arm after recovery says nothing of the next.
"""

from __future__ import annotations

from typing import Any, Protocol


class Log(Protocol):
    """The part of a structlog logger used here."""

    def warning(self, event: str, **fields: Any) -> Any: ...

    def info(self, event: str, **fields: Any) -> Any: ...


class Outage:
    """One dependency's outage state: `failed` on each failed attempt, `ok` on each success.

    `down` is logged at warning with the caller's fields and `error` (cut to `error_chars`
    characters when set), on the first failure after a success (or ever); `up` is logged at
    info with the caller's fields when a success ends an outage (None: recovery is silent).
    """

    def __init__(self, log: Log, down: str, up: str | None = None, *, error_chars: int | None = None) -> None:
        self.log = log
        self.down_event = down
        self.up_event = up
        self.error_chars = error_chars
        self.down = False  # a failure was seen and no success since

    def failed(self, error: object, **fields: Any) -> bool:
        """A failed attempt; logs it if it starts an outage. True if it logged."""
        if self.down:
            return False
        self.down = True
        text = str(error)
        if self.error_chars is not None:
            text = text[: self.error_chars]
        self.log.warning(self.down_event, **fields, error=text)
        return True

    def ok(self, **fields: Any) -> bool:
        """A successful attempt; ends the outage if one is on (logging `up`, if set), so the
        next failure is logged again. True if it ended one."""
        if not self.down:
            return False
        self.down = False
        if self.up_event is not None:
            self.log.info(self.up_event, **fields)
        return True
