"""One naming style for log events: each event is a fixed phrase in plain words ("fleet
config refused", "redis reachable again"), the same text every time it is logged; what varies
goes in the event's fields. Never an f-string or a concatenation (one event would have many
names, and no query or alert could find it), never a dotted identifier (`quota.reloaded`: the
other style). Read from the source with `ast`, as test_import_cycles reads imports."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "controlplane"
LEVELS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "msg"}
GENERATED = ("v1", "keda")
DOTTED = re.compile(r"^[a-z_]+(\.[a-z_]+)+$")
# A phrase: starts with a lowercase letter or digit, no placeholder braces or %-formats.
PHRASE = re.compile(r"^[a-z0-9][^{}%]*$")


def _loggers(tree: ast.AST) -> set[str]:
    """Names bound to structlog.get_logger(...) anywhere in the module."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            f = node.value.func
            if isinstance(f, ast.Attribute) and f.attr == "get_logger":
                found.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return found


def events(source: str, where: str) -> Iterator[tuple[str, int, ast.expr]]:
    """(where, line, event expression) of every log call and every Outage(...) event."""
    tree = ast.parse(source)
    loggers = _loggers(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in LEVELS and isinstance(f.value, ast.Name):
            if f.value.id in loggers and node.args:
                yield where, node.lineno, node.args[0]
        elif isinstance(f, ast.Name) and f.id == "Outage":
            yield from ((where, node.lineno, a) for a in node.args[1:3])


def problem(expr: ast.expr) -> str | None:
    """Why an event expression breaks the style, or None. A choice between two fixed phrases
    (`"leadership gained" if now else "leadership lost"`) is two events, each fixed."""
    if isinstance(expr, ast.IfExp):
        return problem(expr.body) or problem(expr.orelse)
    if isinstance(expr, ast.Constant) and expr.value is None:
        return None  # Outage's optional recovery event
    if not (isinstance(expr, ast.Constant) and isinstance(expr.value, str)):
        return f"not a fixed phrase: {ast.unparse(expr)}"
    if DOTTED.match(expr.value):
        return f"a dotted name, not a phrase: {expr.value!r}"
    if not PHRASE.match(expr.value):
        return f"not a plain lowercase phrase: {expr.value!r}"
    return None


def all_events() -> list[tuple[str, int, ast.expr]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in GENERATED:
            continue
        out += events(path.read_text(), str(rel))
    return out


def test_every_log_event_is_one_fixed_phrase() -> None:
    found = all_events()
    assert len(found) > 50, "log calls not read"
    bad = [f"controlplane/{w}:{line}: {why}" for w, line, e in found if (why := problem(e))]
    assert not bad, "log events off the style:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("code", "why"),
    [
        ('log.info(f"admin token {state}")', "not a fixed phrase"),
        ('log.info("leadership " + ("gained" if now else "lost"))', "not a fixed phrase"),
        ('log.warning("quota.reload_failed", error=e)', "a dotted name"),
        ("log.info(event)", "not a fixed phrase"),
        ('log.info("Fleet loaded")', "not a plain lowercase phrase"),
        ('log.info("loaded %s models", n)', "not a plain lowercase phrase"),
        ('Outage(log, "picker.peer_unread")', "a dotted name"),
        ('Outage(log, "etcd unreachable", f"etcd back after {s}s")', "not a fixed phrase"),
    ],
)
def test_the_check_finds_each_other_style(code: str, why: str) -> None:
    source = f'import structlog\nlog = structlog.get_logger("x")\ndef f():\n    {code}\n'
    found = list(events(source, "x.py"))
    assert len(found) >= 1
    assert any((problem(e) or "").startswith(why) for _, _, e in found), [problem(e) for _, _, e in found]


@pytest.mark.parametrize(
    "code",
    [
        'log.info("fleet config refused", errors=e)',
        'log.info("leadership gained" if now else "leadership lost")',
        'Outage(log, "etcd unreachable; serving the last fleet", "etcd reachable again")',
        'Outage(log, "cannot share load reports: etcd unreachable")',
        'other.info(f"{x}")',  # not a structlog logger of this module
    ],
)
def test_fixed_phrases_pass(code: str) -> None:
    source = f'import structlog\nlog = structlog.get_logger("x")\ndef f():\n    {code}\n'
    assert [problem(e) for _, _, e in events(source, "x.py")] == [None] * len(list(events(source, "x.py")))
