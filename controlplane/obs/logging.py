"""structlog setup: JSON lines for machines, console for people."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["json", "console"]
CONFIGURED: tuple[LogFormat, str] = ("console", "info")  # as last configured (a child process takes it)


class _CurrentStderr:
    """Whatever sys.stderr is when a line is written (not when logging was configured), so
    a replaced or closed stream (a test harness capturing output) never breaks logging."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(fmt: LogFormat = "console", level: str = "info") -> None:
    """Configure structlog (and stdlib logging) once for the process, writing to stderr."""
    global CONFIGURED
    CONFIGURED = (fmt, level)
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(
        level=lvl,
        stream=_CurrentStderr(),
        format="%(levelname)s %(name)s: %(message)s",
    )
    # The Kubernetes client's HTTP library logs every request (each watch reconnect) at info.
    logging.getLogger("httpx2").setLevel(max(lvl, logging.WARNING))
