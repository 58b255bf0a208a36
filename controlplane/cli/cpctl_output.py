"""What `cpctl` prints: protobuf messages -> plain dicts (json, yaml) and tables for people,
plus the shell completion script generated from the argument parser.

Everything here is pure (messages in, text out), so it is unit-tested without a server.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from controlplane.v1 import autoscaling_pb2, endpoint_pb2, proxy_pb2, rollout_pb2

FORMATS = ("table", "json", "yaml")
XDS_TYPES = ("cds", "eds", "lds", "rds")

# ---- values -------------------------------------------------------------------------------


def seconds_text(s: float) -> str:
    """0.25 -> 250ms, 1.5 -> 1.5s, 90 -> 1m30s, 120 -> 2m."""
    if s < 1:
        return f"{s * 1000:.0f}ms"
    if s < 60:
        return f"{s:.3g}s"
    minutes, rest = divmod(round(s), 60)
    return f"{minutes}m{rest}s" if rest else f"{minutes}m"


def percent_text(rate: float) -> str:
    """0.0123 -> 1.23%."""
    return f"{rate * 100:.2f}%"


def number_text(x: float) -> str:
    """A count that may be fractional: 3.0 -> 3, 2.5 -> 2.5."""
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


UNKNOWN = "unknown"  # a figure never read: not "0", which reads as idle


def figure(e: endpoint_pb2.Endpoint, name: str) -> float | None:
    """An optional field of a message: None when unset (never read)."""
    return float(getattr(e, name)) if e.HasField(name) else None


def local_time(unix: float) -> str:
    """Unix time -> local ISO time with its offset, to the second."""
    return datetime.datetime.fromtimestamp(unix).astimezone().isoformat(timespec="seconds")


def rfc3339(unix: float) -> str | None:
    """Unix time -> RFC 3339 in UTC to the second (2026-12-02T07:00:00Z); None for 0 (unset)."""
    if not unix or not math.isfinite(unix):
        return None
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def plain(doc: Any) -> Any:
    """The document with whole floats as integers (a count of 12, never 12.0) and numbers
    that are not finite as None (JSON has no NaN); everything else unchanged."""
    if isinstance(doc, float):
        if not math.isfinite(doc):
            return None
        return int(doc) if doc.is_integer() else doc
    if isinstance(doc, dict):
        return {k: plain(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [plain(v) for v in doc]
    return doc


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart; no trailing spaces."""
    all_rows = [list(headers), *(list(r) for r in rows)]
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in all_rows)


def dump(doc: Any, fmt: str, *, one_line: bool = False) -> str:
    """A document as json (indented, or on one line) or yaml (keys in the order given), with
    whole numbers as integers (`plain`)."""
    doc = plain(doc)
    if fmt == "json":
        return json.dumps(doc, separators=(",", ":")) if one_line else json.dumps(doc, indent=2)
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False).rstrip("\n")


# ---- rollouts -----------------------------------------------------------------------------


def analysis_to_dict(va: rollout_pb2.VersionAnalysis) -> dict[str, Any]:
    return {
        "version": va.version,
        "requests": va.requests,
        "error_rate": va.error_rate,
        "p99_seconds": va.p99_seconds if va.HasField("p99_seconds") else None,
    }


@dataclass(frozen=True)
class Roles:
    """Which version plays which part in a rollout, as an operator reads it."""

    stable: str  # takes the traffic the canary does not
    canary: str | None  # None once Completed: it has become the stable version
    previous: str | None  # the stable version a Completed rollout replaced; else None


def roles(r: rollout_pb2.Rollout) -> Roles:
    """The versions' parts, for the table and for json/yaml alike. The server's
    stable_version and canary_version are where the rollout started from and went to; once
    Completed the canary is the stable version, there is no canary, and the old stable is the
    one it replaced. An Aborted rollout keeps its canary (at 0%): the version it gave up on."""
    if r.phase == "Completed":
        return Roles(stable=r.canary_version, canary=None, previous=r.stable_version)
    return Roles(stable=r.stable_version, canary=r.canary_version or None, previous=None)


def ordered_weights(r: rollout_pb2.Rollout) -> dict[str, int]:
    """version -> percent: stable first, then the canary, the version it replaced, then any
    other version by name."""
    role = roles(r)
    first = [v for v in (role.stable, role.canary, role.previous) if v is not None and v in r.weights]
    rest = sorted(v for v in r.weights if v not in first)
    return {v: int(r.weights[v]) for v in (*dict.fromkeys(first), *rest)}


def rollout_to_dict(r: rollout_pb2.Rollout) -> dict[str, Any]:
    """The rollout as a plain dict with snake_case keys; the versions' parts as `roles` gives
    them (the table's); `canary` and `stable` only when the server sent analysis figures
    (while the rollout runs)."""
    role = roles(r)
    d: dict[str, Any] = {
        "model": r.model,
        "phase": r.phase,
        "step": r.step,
        "finishing": r.finishing,
        "steps": list(r.steps),
        "weights": ordered_weights(r),
        "stable_version": role.stable,
        "canary_version": role.canary,
        "previous_version": role.previous,
        "reason": r.reason,
        "manual": r.manual,
        "interval_seconds": r.interval_seconds,
        "max_error_rate": r.max_error_rate,
        "max_latency_ratio": r.max_latency_ratio,
        "min_requests": r.min_requests,
        "ack_deadline_seconds": r.ack_deadline_seconds,
        "step_started_at": rfc3339(r.step_started_at),
    }
    if r.HasField("canary"):
        d["canary"] = analysis_to_dict(r.canary)
    if r.HasField("stable"):
        d["stable"] = analysis_to_dict(r.stable)
    return d


def step_text(r: rollout_pb2.Rollout) -> str:
    """2/4 (25%), or 0/4 while the proxies have not all got the canary yet."""
    total = len(r.steps)
    if r.step == 0:
        return f"0/{total} (waiting for every proxy to have the canary)"
    if 0 < r.step <= total:
        return f"{r.step}/{total} ({r.steps[r.step - 1]}%)"
    return f"{r.step}/{total}"


def weights_text(r: rollout_pb2.Rollout) -> str:
    return ", ".join(f"{v} {w}%" for v, w in ordered_weights(r).items()) or "-"


def summary_line(r: rollout_pb2.Rollout) -> str:
    """One line after a command: llama: Progressing, step 1/4 (5%), v1 95%, v2 5%."""
    return f"{r.model}: {r.phase}, step {step_text(r)}, {weights_text(r)}"


def watch_state(r: rollout_pb2.Rollout) -> tuple[Any, ...]:
    """What a line of an unattended watch reports: a new line only when this changes (the
    analysis figures, which move every second while traffic flows, are left out)."""
    return (
        r.phase,
        r.step,
        r.finishing,
        tuple(ordered_weights(r).items()),
        r.stable_version,
        r.canary_version,
        r.reason,
    )


def watch_line(r: rollout_pb2.Rollout, clock: str) -> str:
    """One line per change of a watch without a terminal:
    `07:00:01  llama: Progressing, step 1/4 (5%), v1 95%, v2 5%; reason`."""
    return f"{clock}  {summary_line(r)}" + (f"; {r.reason}" if r.reason else "")


def rollout_table(r: rollout_pb2.Rollout, now: float | None = None) -> str:
    """The short human view of one rollout (`cpctl rollout status`)."""
    gates = (
        "manual gates (cpctl rollout promote)" if r.manual else f"every {seconds_text(r.interval_seconds)}"
    )
    role = roles(r)
    lines = [
        f"Model:    {r.model}",
        f"Phase:    {r.phase}",
        f"Step:     {step_text(r)}  [{', '.join(f'{s}%' for s in r.steps)}; {gates}]",
        f"Weights:  {weights_text(r)}",
        f"Stable:   {role.stable}" + (f"  (replaced {role.previous})" if role.previous else ""),
        f"Canary:   {role.canary or '-'}",
        f"Reason:   {r.reason or '-'}",
    ]
    if r.step_started_at and now is not None and r.phase in ("Progressing", "Paused"):
        lines.append(
            f"Since:    {local_time(r.step_started_at)} ({seconds_text(max(now - r.step_started_at, 0))} ago)"
        )
    figures = [(role, getattr(r, role)) for role in ("canary", "stable") if r.HasField(role)]
    if figures:
        lines.append("Analysis (since the step began):")
        rows = [
            [
                va.version,
                role,
                number_text(va.requests),
                percent_text(va.error_rate),
                seconds_text(va.p99_seconds) if va.HasField("p99_seconds") else "-",
            ]
            for role, va in figures
        ]
        sub = table(["VERSION", "ROLE", "REQUESTS", "ERRORS", "P99"], rows)
        lines += ["  " + line for line in sub.splitlines()]
        lines.append(
            f"  limits: errors <= {percent_text(r.max_error_rate)}, p99 <= {r.max_latency_ratio:g}x stable, "
            f"judged from {r.min_requests} canary requests"
        )
    return "\n".join(lines)


def rollouts_table(rollouts: Sequence[rollout_pb2.Rollout]) -> str:
    if not rollouts:
        return "no rollouts yet (start one with `cpctl rollout start MODEL --to VERSION`)"
    rows = [
        [
            r.model,
            r.phase,
            step_text(r).split(" ")[0],
            weights_text(r),
            role.stable,
            role.canary or "-",
            r.reason,
        ]
        for r, role in ((r, roles(r)) for r in rollouts)
    ]
    return table(["MODEL", "PHASE", "STEP", "WEIGHTS", "STABLE", "CANARY", "REASON"], rows)


def record_to_dict(a: rollout_pb2.AuditRecord) -> dict[str, Any]:
    return {
        "at": rfc3339(a.at),
        "who": a.who,
        "phase": a.phase,
        "step": a.step,
        "weight": a.weight,
        "reason": a.reason,
    }


def history_table(records: Sequence[rollout_pb2.AuditRecord]) -> str:
    if not records:
        return "no history"
    rows = [[local_time(a.at), a.phase, str(a.step), f"{a.weight}%", a.who, a.reason] for a in records]
    return table(["TIME", "PHASE", "STEP", "CANARY", "WHO", "REASON"], rows)


# ---- endpoints ----------------------------------------------------------------------------


def endpoint_to_dict(e: endpoint_pb2.Endpoint) -> dict[str, Any]:
    return {
        "model": e.model,
        "version": e.version,
        "address": e.address,
        "gpu": e.gpu,
        "state": e.state,
        "weight": e.weight,
        "capacity": e.capacity,
        # null: never read (no page yet, or a server that does not report it), not idle
        "running": figure(e, "running"),
        "waiting": figure(e, "waiting"),
        "in_flight": e.in_flight,
        "kv_use": figure(e, "kv_use"),
        "latency_seconds": figure(e, "latency_seconds"),
        "error_rate": figure(e, "error_rate"),
        # what a request costs there (vLLM's pages), as the picker weighs a cached prompt
        "prefill_seconds_per_token": figure(e, "prefill_seconds_per_token"),
        "decode_seconds_per_request": figure(e, "decode_seconds_per_request"),
        # LoRA adapters held (vLLM): null when unknown, [] when known to be none
        "running_adapters": list(e.running_adapters) if e.HasField("max_adapters") else None,
        "waiting_adapters": list(e.waiting_adapters) if e.HasField("max_adapters") else None,
        "max_adapters": e.max_adapters if e.HasField("max_adapters") else None,
        "signal_age_seconds": e.signal_age_seconds if e.signal_age_seconds >= 0 else None,
        "drain_started_at": rfc3339(e.drain_started_at),
        "sight": e.sight,
        "note": e.note,
        "source": e.source or "file",
        "last_seen_seconds": e.last_seen_seconds if e.HasField("last_seen_seconds") else None,
        "scrape_error": e.scrape_error or None,
        "scrape_error_reason": e.scrape_error_reason or None,
    }


def load_notes(note: str | None, scrape_error: str | None, scrape_error_reason: str | None) -> list[str]:
    """What is said under an endpoint's row (cpctl endpoints list, explain): why it is held
    out or out of sight (`note`), and why its last scrape read no load when the server answered
    (a page refused, an HTTP error). No answer is the sight's business: after 3 the note says
    it is out of sight."""
    notes = [note] if note else []
    if scrape_error and scrape_error_reason != "unreachable" and scrape_error not in (note or ""):
        notes.append(f"last scrape read no load ({scrape_error_reason or 'other'}): {scrape_error}")
    return notes


def endpoint_notes(e: endpoint_pb2.Endpoint) -> list[str]:
    """load_notes of an endpoint message."""
    return load_notes(e.note, e.scrape_error, e.scrape_error_reason)


ADAPTERS_SHOWN = 3  # names shown per list in the table; the rest are counted (+N)


def adapter_names_text(names: Sequence[str]) -> str:
    """['a', 'b', 'c', 'd', 'e'] -> 'a,b,c+2'; [] -> 'none'."""
    if not names:
        return "none"
    more = len(names) - ADAPTERS_SHOWN
    return ",".join(names[:ADAPTERS_SHOWN]) + (f"+{more}" if more > 0 else "")


def adapters_text(e: endpoint_pb2.Endpoint) -> str:
    """The adapters column: 'a,b (2 slots)' running, then '; waiting c' for the waiting ones
    not also running (a vLLM 0.32 names every adapter in flight in both lists: nothing to
    add); '-' unknown."""
    if not e.HasField("max_adapters"):
        return "-"
    slots = f"{e.max_adapters} slot{'' if e.max_adapters == 1 else 's'}"
    text = f"{adapter_names_text(e.running_adapters)} ({slots})"
    running = set(e.running_adapters)
    only_waiting = [name for name in e.waiting_adapters if name not in running]
    return text + (f"; waiting {adapter_names_text(only_waiting)}" if only_waiting else "")


def endpoints_table(endpoints: Sequence[endpoint_pb2.Endpoint]) -> str:
    """One row per endpoint, the notes under them, then where discovered ones come from. The
    ADAPTERS column (LoRA adapters held) is shown only when some endpoint has them known: a
    fleet without LoRA gets no column of dashes."""
    if not endpoints:
        return "no endpoints"
    adapters = any(e.HasField("max_adapters") for e in endpoints)
    rows = [
        [
            e.model,
            e.version,
            e.address,
            e.gpu or "-",
            e.state + (" (out of sight)" if e.sight == "OUT_OF_SIGHT" else ""),
            str(e.weight),
            number_text(e.running) if e.HasField("running") else UNKNOWN,
            number_text(e.waiting) if e.HasField("waiting") else UNKNOWN,
            number_text(e.in_flight),
            seconds_text(e.latency_seconds) if e.HasField("latency_seconds") else UNKNOWN,
            percent_text(e.error_rate) if e.HasField("error_rate") else UNKNOWN,
            *([adapters_text(e)] if adapters else []),
        ]
        for e in endpoints
    ]
    headers = ["MODEL", "VERSION", "ADDRESS", "GPU", "STATE", "WEIGHT", "RUNNING", "WAITING", "IN-FLIGHT"]
    out = table([*headers, "LATENCY", "ERRORS", *(["ADAPTERS"] if adapters else [])], rows)
    notes = [f"{e.model}/{e.version} {e.address}: {n}" for e in endpoints for n in endpoint_notes(e)]
    out += "\n\n" + "\n".join(notes) if notes else ""
    found = [
        f"{e.model}/{e.version} {e.address}: {e.source}"
        + (f", last seen {seconds_text(e.last_seen_seconds)} ago" if e.HasField("last_seen_seconds") else "")
        for e in endpoints
        if e.source and e.source != "file"
    ]
    return out + ("\n\nDiscovered:\n  " + "\n  ".join(found) if found else "")


# ---- autoscaling --------------------------------------------------------------------------

WHOLE_MODEL = "(all)"  # the VERSION shown for a whole model's decision (version "")


def scaling_to_dict(s: autoscaling_pb2.ModelScaling) -> dict[str, Any]:
    return {
        "model": s.model,
        "version": s.version,
        "desired": s.desired,
        "ready": s.ready,
        "demand": s.demand,
        "stable_demand": s.stable_demand,
        "panic_demand": s.panic_demand,
        "target_per_replica": s.target_per_replica,
        "panicking": s.panicking,
        "active": s.active,
        "reason": s.reason,
        "idle_seconds": s.idle_seconds,
        "predicted_demand": s.predicted_demand if s.HasField("predicted_demand") else None,
        "forecast_method": s.forecast_method,
        "lead_seconds": s.lead_seconds,
        "min": s.min,
        "max": s.max,
        "remove": list(s.remove),
        "draining": list(s.draining),
    }


def forecast_text(s: autoscaling_pb2.ModelScaling) -> str:
    """- without a forecast; else `14 (holt, 30s ahead)`."""
    if not s.HasField("predicted_demand"):
        return "-"
    details = [s.forecast_method] if s.forecast_method else []
    if s.lead_seconds > 0:
        details.append(f"{seconds_text(s.lead_seconds)} ahead")
    return number_text(s.predicted_demand) + (f" ({', '.join(details)})" if details else "")


def _address_lines(rows: Sequence[autoscaling_pb2.ModelScaling], field: str) -> list[str]:
    """One line per row naming its addresses in `field`; a version's line only when it names
    one its model's line does not (the stable version's usually repeats the model's)."""
    whole = {s.model: set(getattr(s, field)) for s in rows if not s.version}
    lines = []
    for s in rows:
        addresses = list(getattr(s, field))
        if not addresses or (s.version and set(addresses) <= whole.get(s.model, set())):
            continue
        name = f"{s.model}/{s.version}" if s.version else s.model
        lines.append(f"  {name}: {', '.join(addresses)}")
    return lines


def scaling_table(rows: Sequence[autoscaling_pb2.ModelScaling]) -> str:
    """One row per decision (a whole model's VERSION is (all)), then the endpoints a
    scale-down would drain next and those draining now."""
    if not rows:
        return "no autoscaling decisions yet (the autoscaler decides every signals round)"
    out = table(
        ["MODEL", "VERSION", "DESIRED", "READY", "DEMAND", "TARGET", "FORECAST", "REASON"],
        [
            [
                s.model,
                s.version or WHOLE_MODEL,
                str(s.desired),
                str(s.ready),
                number_text(s.demand),
                number_text(s.target_per_replica),
                forecast_text(s),
                s.reason,
            ]
            for s in rows
        ],
    )
    remove = _address_lines(rows, "remove")
    draining = _address_lines(rows, "draining")
    if remove:
        out += "\n\nScale-down would drain next:\n" + "\n".join(remove)
    if draining:
        out += "\n\nDraining now:\n" + "\n".join(draining)
    return out


# ---- proxies ------------------------------------------------------------------------------


def proxy_to_dict(p: proxy_pb2.Proxy) -> dict[str, Any]:
    return {
        "node_id": p.node_id,
        "node_cluster": p.node_cluster,
        "address": p.address,
        "user_agent": p.user_agent,
        "version": p.version,
        "notes": list(p.notes),
        "service": p.service,
        "transport": p.transport,
        "connected_seconds": p.connected_seconds,
        "types": {
            t.type: {
                "status": t.status,
                "acked_version": t.acked_version,
                "last_nack": t.last_nack,
                "reason": t.reason,
                "resources": t.resources,
            }
            for t in p.types
        },
    }


def proxies_table(proxies: Sequence[proxy_pb2.Proxy]) -> str:
    """One row per xDS stream with each type's sync status, then the last NACK messages."""
    if not proxies:
        return "no proxies connected"
    rows = []
    nacks = []
    why = []
    for p in proxies:
        by_type = {t.type: t for t in p.types}
        node = p.node_id or "-"
        rows.append(
            [node, p.address, p.transport, *(by_type[x].status if x in by_type else "-" for x in XDS_TYPES)]
        )
        nacks += [
            f"  {node} ({p.address}) {x.upper()}: {by_type[x].last_nack}"
            for x in XDS_TYPES
            if x in by_type and by_type[x].last_nack
        ]
        why += [
            f"  {node} ({p.address}) {x.upper()} {by_type[x].status}: {by_type[x].reason}"
            for x in XDS_TYPES
            if x in by_type and by_type[x].reason and by_type[x].status != "NACKED"
        ]
        why += [f"  {node} ({p.address}): {note}" for note in p.notes]
    out = table(["NODE", "ADDRESS", "TRANSPORT", *(x.upper() for x in XDS_TYPES)], rows)
    if nacks:
        out += "\n\nLast NACKs:\n" + "\n".join(nacks)
    if why:
        out += "\n\nNot in sync:\n" + "\n".join(why)
    return out


# ---- version ------------------------------------------------------------------------------


def version_doc(client: str, server: str | None, address: str) -> dict[str, Any]:
    """`cpctl version -o json|yaml`: the client's build, and the server's when it answered."""
    doc: dict[str, Any] = {"client": {"version": client}}
    if server is not None:
        doc["server"] = {"version": server, "address": address}
    return doc


def version_text(client: str, server: str | None, address: str) -> str:
    """`cpctl version`, as kubectl prints it: the client line, then the server's if it answered."""
    lines = [f"Client Version: {client}"]
    if server is not None:
        lines.append(f"Server Version: {server} ({address})")
    return "\n".join(lines)


# ---- shell completion ---------------------------------------------------------------------

# What `cpctl __complete KIND` lists for an argument, by the argument's dest: names asked of
# the control plane as the user types (the fleet's models, a model's versions, endpoints).
DYNAMIC = {"model": "models", "to_version": "versions", "address": "addresses"}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name (none for a leaf command)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _walk(
    parser: argparse.ArgumentParser, path: str = ""
) -> Iterable[tuple[str, argparse.ArgumentParser, list[str]]]:
    """(command path, its parser, its subcommand names) for the parser and every subcommand."""
    subs = {n: p for n, p in subcommands(parser).items() if not n.startswith("__")}  # hidden
    yield path, parser, list(subs)
    for name, sub in subs.items():
        yield from _walk(sub, f"{path} {name}".strip())


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    """A bash completion script for every command path, flag and flag value choice of
    `parser`, and for model, version and endpoint names, which it asks the control plane for
    (`cpctl __complete`, with the --server and --token-file typed so far); for zsh, the same
    script run through bashcompinit."""
    prog = parser.prog
    fn = "_" + prog.replace("-", "_")
    words: list[str] = []
    flags: list[str] = []
    choices: list[str] = []
    dynamic: list[str] = []
    takes_value: set[str] = set()
    files: set[str] = set()
    for path, p, subs in _walk(parser):
        opts = sorted(o for a in p._actions for o in a.option_strings if a.help != argparse.SUPPRESS)
        words.append(f'        "{path}") echo "{" ".join(subs)}" ;;')
        flags.append(f'        "{path}") echo "{" ".join(opts)}" ;;')
        for a in p._actions:
            kind = DYNAMIC.get(a.dest)
            if not a.option_strings:
                if a.choices and not subs:
                    choices.append(f'        "{path}|") echo "{" ".join(str(c) for c in a.choices)}" ;;')
                elif kind and not subs:
                    dynamic.append(f'        "{path}|") echo "{kind}" ;;')
                continue
            if a.nargs == 0:
                continue
            takes_value.update(a.option_strings)
            if a.choices:
                values = " ".join(str(c) for c in a.choices)
                choices += [f'        "{path}|{o}") echo "{values}" ;;' for o in a.option_strings]
            elif kind:
                dynamic += [f'        "{path}|{o}") echo "{kind}" ;;' for o in a.option_strings]
            elif a.metavar in ("FILE", "DIR"):
                files.update(a.option_strings)
    script = f"""\
# {shell} completion for {prog}; load it with: source <({prog} completion {shell})
{fn}_words() {{
    case "$1" in
{chr(10).join(words)}
    esac
}}
{fn}_flags() {{
    case "$1" in
{chr(10).join(flags)}
    esac
}}
{fn}_choices() {{
    case "$1" in
{chr(10).join(choices)}
    esac
}}
{fn}_dynamic() {{
    case "$1" in
{chr(10).join(dynamic)}
    esac
}}
{fn}_takes_value() {{
    case "$1" in
        {"|".join(sorted(takes_value))}) return 0 ;;
    esac
    return 1
}}
{fn}() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="" path="" i w before kids kind model="" npos=0
    local conn=()
    (( COMP_CWORD > 0 )) && prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    for (( i = 1; i < COMP_CWORD; i++ )); do
        w="${{COMP_WORDS[i]}}"
        before="${{COMP_WORDS[i-1]}}"
        case "$before" in
            --server|--token-file) conn+=("$before" "$w") ;;
        esac
        kids=" $({fn}_words "$path") "
        if [[ "$w" != -* && "$kids" == *" $w "* ]]; then
            path="${{path:+$path }}$w"
        elif [[ "$w" != -* ]] && ! {fn}_takes_value "$before"; then
            (( npos == 0 )) && model="$w"  # the command's first argument: the model
            npos=$(( npos + 1 ))
        fi
    done
    case "$prev" in
        {"|".join(sorted(files)) or "--no-such-flag"})
            COMPREPLY=($(compgen -f -- "$cur")); return ;;
    esac
    local values="$({fn}_choices "$path|$prev")"
    if [[ -n "$values" ]]; then
        COMPREPLY=($(compgen -W "$values" -- "$cur")); return
    fi
    kind="$({fn}_dynamic "$path|$prev")"
    if [[ -z "$kind" ]] && {fn}_takes_value "$prev"; then
        COMPREPLY=(); return
    fi
    if [[ -z "$kind" && "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$({fn}_flags "$path")" -- "$cur")); return
    fi
    if [[ -z "$kind" ]]; then
        w="$({fn}_words "$path")"
        [[ -z "$w" ]] && w="$({fn}_choices "$path|")"
        [[ -z "$w" ]] && (( npos == 0 )) && kind="$({fn}_dynamic "$path|")"
    fi
    if [[ -n "$kind" ]]; then
        # Names from the control plane (1s deadline; nothing when it cannot be asked).
        w="$("${{COMP_WORDS[0]}}" "${{conn[@]}}" __complete "$kind" $model 2>/dev/null)"
    fi
    COMPREPLY=($(compgen -W "$w" -- "$cur"))
}}
complete -F {fn} {prog}
"""
    if shell == "zsh":
        script = (
            "# zsh: bash-style completion through bashcompinit\n"
            "(( $+functions[compdef] )) || { autoload -Uz compinit && compinit; }\n"
            "autoload -Uz bashcompinit && bashcompinit\n" + script
        )
    return script


def _shown(name: str) -> str:
    """A name as one printable cell: a tenant is whatever a client sent as its key."""
    return "".join(c if c.isprintable() and c != " " else repr(c)[1:-1] for c in name)


def quota_rows(rows: Iterable[dict[str, Any]]) -> list[list[str]]:
    """`cpctl quota status`'s table cells, one row per bucket."""
    return [
        [
            _shown(r["tenant"]) if r["tenant"] else "(no key)",
            _shown(r["model"]),
            r["kind"],
            str(r["limit_per_minute"]),
            str(r["remaining"]),
            f"{r['reset_seconds']:g}s",
        ]
        for r in rows
    ]


def quota_json(rows: Sequence[dict[str, Any]]) -> str:
    """`cpctl quota status -o json`: {"buckets": [...]}, a bucket to a line. json.dumps with an
    indent encodes in Python, about 10 s for 100,000 buckets; each line is encoded in C."""
    if not rows:
        return '{\n  "buckets": []\n}'
    lines = ",\n".join("    " + json.dumps(r) for r in rows)
    return '{\n  "buckets": [\n' + lines + "\n  ]\n}"
