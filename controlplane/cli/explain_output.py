"""What `controlplane explain` prints: the explanation (a plain dict, explain.py) as a table
for people, or as json or yaml for scripts. Pure: the document in, text out."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from controlplane.cli import cpctl_output as cpctl
from controlplane.cli.explain_live import started_from


def fmt_duration(seconds: float) -> str:
    """60.0 -> '60s', 0.5 -> '500ms', 90.0 -> '90s'."""
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    return f"{seconds:g}s"


def fmt_bytes(n: int) -> str:
    """8388608 -> '8388608 (8 MiB)'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n} ({n / size:g} {unit})"
    return str(n)


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [(indent + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r))).rstrip() for r in rows]


def _tier_text(e: Mapping[str, Any]) -> str:
    tier, bound = e["tier"], e["tier"]["max_params_b"]
    if tier["chosen_by"] == "model":
        how = "named by the model" + (f"; holds up to {bound:g}B" if bound is not None else "")
    else:
        how = f"from params_b {e['params_b']:g}" + (f" <= {bound:g}" if bound is not None else ", unbounded")
    return f"{tier['name']}  ({how})"


def _policy_rows(settings: Mapping[str, Any]) -> list[list[str]]:
    rows = [["KEY", "VALUE", "SOURCE", ""]]
    for key, entry in settings.items():
        note = "unset: follows the timeout" if entry["follows"] == "timeout" else ""
        rows.append([key, entry["text"], entry["source"], note])
    return rows


def _retry_lines(retry: Mapping[str, Any] | None) -> list[str]:
    if retry is None:
        return ["none (retries 0)"]
    on = [*retry["retry_on"], *(str(c) for c in retry["retriable_status_codes"])]
    lines = [f"up to {retry['num_retries']} on {', '.join(on)}"]
    if retry["other_host"]:
        lines.append("each retry to another host (previous_hosts)")
    n = retry["next_priority_after_attempts"]
    if n is not None:
        lines.append(
            f"after {n} failed attempts the next goes to the next EDS priority (previous_priorities)"
        )
    lines.append("never once response headers have gone to the client")
    return lines


def _envoy_rows(e: Mapping[str, Any]) -> list[list[str]]:
    env, rows = e["envoy"], []
    route = env["route"]
    if route:
        rows.append(
            ["route timeout", f"{fmt_duration(route['timeout_s'])}: the whole request, streaming included"]
        )
        idle = route["idle_timeout_s"]
        rows.append(
            [
                "idle timeout",
                ("none" if idle is None else fmt_duration(idle))
                + ": longest silence, the wait for response headers included",
            ]
        )
        rows.append(["routing priority", route["routing_priority"]])
    retry = _retry_lines(env["retry"])
    rows += [["retries" if i == 0 else "", line] for i, line in enumerate(retry)]
    budget = (env["circuit_breakers"].get("default") or {}).get("retry_budget")
    if budget:
        share, least = budget["percent"], budget["min_concurrency"]
        rows.append(["retry budget", f"{share:g}% of requests in flight may be retries, at least {least}"])
    limits = env["body_limit"]
    if limits["header_routed_bytes"] is not None:
        rows.append(["max body", f"{fmt_bytes(limits['header_routed_bytes'])} with the x-model header"])
    if limits["body_routed_bytes"] is not None:
        rows.append(
            ["", f"{fmt_bytes(limits['body_routed_bytes'])} if named in the JSON body (listener-wide)"]
        )
    for prio in ("default", "high"):
        b = env["circuit_breakers"].get(prio)
        text = "Envoy defaults" if b is None else f"{b['max_requests']} in flight, {b['max_pending']} pending"
        rows.append([f"breaker {prio}", text])
    od = env["outlier_detection"]
    counted = "507 and connection failures included" if od["local_origin_errors_count"] else "507 included"
    rows.append(["outlier detection", f"eject after {od['consecutive_5xx']} consecutive 5xx ({counted})"])
    rows.append(
        [
            "",
            f"for {fmt_duration(od['base_ejection_time_s'])} x ejections in a row, at most "
            f"{od['max_ejection_percent']}% of hosts at once; swept every {fmt_duration(od['interval_s'])}",
        ]
    )
    if od["enforcing_consecutive_5xx"] != 100:
        rows.append(["", f"enforced for {od['enforcing_consecutive_5xx']}% of detections"])
    panic = env["healthy_panic_threshold_percent"]
    if panic == 0:
        rows.append(["panic mode", "off (threshold 0%): no healthy endpoint -> 503"])
    else:
        rows.append(["panic mode", "Envoy default (50%)" if panic is None else f"threshold {panic:g}%"])
    lb = env["load_balancer"] or "Envoy default"
    weighted = " with the control plane's weights" if lb == "least_request" else ""
    pk = env.get("picker")
    if pk is not None:
        fallback = pk["fallback"] or "Envoy default"
        weighted = " with the control plane's weights" if fallback == "least_request" else ""
        rows.append(
            [
                "balancing",
                f"{e['settings']['balancing']['text']}: Envoy {lb} (the host the picker names), "
                f"else {fallback}{weighted}",
            ]
        )
        budget = "" if pk["budget_s"] is None else f" within {fmt_duration(pk['budget_s'])}"
        rows.append(
            ["picker", f"asks {', '.join(pk['endpoints'])}{budget}; past it, down or failing: {fallback}"]
        )
        rows.append(["", "fallbacks counted in " + " and ".join(pk["fallbacks_counted_in"])])
        if pk.get("prefix_index") is not None:
            rows.append(["prefix index", pk["prefix_index"]["text"]])
    else:
        rows.append(["balancing", f"{e['settings']['balancing']['text']}: Envoy {lb}{weighted}"])
    if env.get("adapters") is not None:
        rows.append(["LoRA adapters", env["adapters"]["text"]])
    aff = e["affinity"]
    if aff is not None:
        key = (
            f"header {aff['header']}"
            if aff["header"]
            else f"JSON body field {aff['body_field']}"
            if aff["body_field"]
            else "adapter a request names (the base model's requests spread)"
            if aff.get("adapter")
            else "prompt's leading part"
        )
        rows.append(
            ["affinity", f"{aff['algorithm']} on the {key}, bounded at {aff['balance_factor']}% of mean load"]
        )
    rows.append(["connect timeout", fmt_duration(env["connect_timeout_s"])])
    g = env["proxyless_grpc"]
    if g is not None:
        idle = (
            "no idle timeout" if g["idle_timeout_s"] is None else f"idle {fmt_duration(g['idle_timeout_s'])}"
        )
        retries = "no retries, no body limit" if not g["retries"] else f"{g['retries']} retries"
        rows.append(["proxyless gRPC", f"timeout {fmt_duration(g['timeout_s'])}; {idle}; {retries}"])
    return rows


def _memory_rows(e: Mapping[str, Any]) -> list[list[str]]:
    mem, f = e["memory"], e["failover"]
    need = mem["formula"] if mem["need_gb"] is None else f"{mem['need_gb']:g} GB, {mem['formula']}"
    rows = [["need", need]]
    rows.append(["preferred GPUs", ", ".join(mem["preferred_gpus"]) or "none: every endpoint at priority 0"])
    if f["held_out_after_s"] is not None:
        rows.append(
            [
                "dead endpoint",
                f"held out (EDS UNHEALTHY) after {f['held_out_after_scrapes']} failed scrapes in a row "
                f"(about {fmt_duration(f['held_out_after_s'])})",
            ]
        )
    return rows


_WHERE = {"gpu_class": "class", "endpoint": "endpoint"}


def _endpoint_row(ep: Mapping[str, Any]) -> list[str]:
    memory = "unknown"
    if ep["gpu_memory_gb"] is not None:
        memory = f"{ep['gpu_memory_gb']:g} GB ({_WHERE[ep['gpu_memory_source']]})"
    capacity = "learnt at run time"
    if ep["capacity"] is not None:
        capacity = f"{ep['capacity']:g} ({_WHERE[ep['capacity_source']]})"
    if ep["eds_priority"] is None:
        eds = f"left out: {ep['reason']}"
    else:
        eds = f"priority {ep['eds_priority']} ({ep['placement']})"
    return [ep["address"], ep["gpu"] or "-", memory, capacity, eds]


def _stable_text(e: Mapping[str, Any]) -> str:
    v = next(v for v in e["versions"] if v["stable"])
    share, cluster = v["traffic_percent"], f"cluster {e['cluster']}"
    live_stable = next((x["name"] for x in e["versions"] if x["role"] == "stable"), e["stable"])
    if v["role"] == "replaced":
        return f"{e['stable']}  (in the file; {live_stable} replaced it: its rollout completed)"
    if v["role"] == "canary":
        return f"{e['stable']}  (in the file; the running rollout's canary, from {live_stable})"
    if share is None:
        return f"{e['stable']}  ({cluster} takes all traffic, unless a rollout moved some: see rollout)"
    if share < 100:
        return f"{e['stable']}  ({cluster} takes {share}% of the traffic while the rollout runs)"
    return f"{e['stable']}  ({cluster} takes all traffic)"


def _rollout_text(e: Mapping[str, Any]) -> str | None:
    """The `rollout` line: the live state, or why it is unknown; None for a single version."""
    r, model = e["rollout"], e["model"]
    see = f"`cpctl rollout status {model}`"
    if not r["asked"]:
        return f"not asked (--offline); {see} shows it" if len(e["versions"]) > 1 else None
    if r["error"] is not None:
        return f"unknown: {r['error']}; {see} shows it"
    if r["state"] is None:
        return f"none  (asked the control plane at {r['server']})"
    summary = str(r["summary"] or r["state"]["phase"]).removeprefix(f"{model}: ")
    if any(v["traffic_percent"] is None for v in e["versions"]):
        return (
            f"{summary}  (live from {r['server']}); it started from {started_from(r['state'])}, not "
            f"the file's stable {e['stable']}: `cpctl endpoints list --model {model}` shows what serves"
        )
    return f"{summary}  (live from {r['server']}; {see})"


def _loads_text(e: Mapping[str, Any]) -> str:
    """The `loads` line: where the endpoints' live loads come from, or why they are unknown."""
    r, see = e["loads"], f"`cpctl endpoints list --model {e['model']}`"
    if not r["asked"]:
        return f"not asked (--offline); {see} shows them"
    if r["error"] is not None:
        return f"unknown: {r['error']}; {see} shows them"
    return f"live from {r['server']}, per version below  ({see})"


def _figure(x: float | None, text: Callable[[float], str] = cpctl.number_text) -> str:
    """A live figure, or unknown when never read (not 0: that would read as idle)."""
    return cpctl.UNKNOWN if x is None else text(x)


def _live_lines(live: list[Mapping[str, Any]]) -> list[str]:
    """The version's endpoints as the control plane sees them, and why any reads no load."""
    if not live:
        return ["  live: the control plane lists no endpoint of this version"]
    rows = [
        ["LIVE", "STATE", "WEIGHT", "RUNNING", "WAITING", "KV USE", "IN-FLIGHT", "LATENCY", "ERRORS", "AGE"]
    ]
    for ep in live:
        age = ep["signal_age_seconds"]
        rows.append(
            [
                ep["address"],
                str(ep["state"]) + (" (out of sight)" if ep["sight"] == "OUT_OF_SIGHT" else ""),
                str(ep["weight"]),
                _figure(ep["running"]),
                _figure(ep["waiting"]),
                _figure(ep["kv_use"], cpctl.percent_text),
                _figure(ep["in_flight"]),
                _figure(ep["latency_seconds"], cpctl.seconds_text),
                _figure(ep["error_rate"], cpctl.percent_text),
                "never read" if age is None else cpctl.seconds_text(age),
            ]
        )
    notes = [
        f"  - {ep['address']}: {n}"
        for ep in live
        for n in cpctl.load_notes(ep["note"], ep["scrape_error"], ep["scrape_error_reason"])
    ]
    return _table(rows) + notes


def _version_status(v: Mapping[str, Any], e: Mapping[str, Any]) -> str:
    share, role, name = v["traffic_percent"], v["role"], v["name"]
    if role == "stable" and not v["stable"]:
        if share == 100:
            return (
                f"stable since its rollout completed: takes the traffic (the file says stable: {e['stable']})"
            )
        return f"stable of the running rollout: {share}% of the traffic (the file says stable: {e['stable']})"
    if role == "stable" and share is None:
        return "stable in the file: takes the traffic unless a rollout moved some"
    if role == "stable":
        return "stable: takes the traffic" if share == 100 else f"stable: {share}% of the traffic"
    if role == "canary":
        return f"canary of the running rollout: {share}% of the traffic"
    if role == "replaced":
        return "replaced by the completed rollout: no traffic; its endpoints drain, then its cluster goes"
    if role == "aborted":
        return "canary of an aborted rollout: no traffic; its endpoints drain"
    if role == "unknown":
        return "not stable in the file; a rollout may send it traffic: see rollout above"
    return f"not stable: only requests with x-model-version: {name} reach it"


def render_text(e: Mapping[str, Any], config: str | None = None) -> str:
    """The explanation for people: aligned columns, one fact per line."""
    lines = [f"model {e['model']}" + (f"  ({config})" if config else "")]
    rollout = _rollout_text(e)
    lines += _table(
        [
            ["tier", _tier_text(e)],
            ["protocol", e["protocol"]],
            ["stable", _stable_text(e)],
            *([["rollout", rollout]] if rollout is not None else []),
            ["loads", _loads_text(e)],
        ]
    )
    lines += ["", "traffic policy  (source: model = models.<name>, tier = tiers.<tier>, default = built in)"]
    lines += _table(_policy_rows(e["settings"]))
    if e["priority_classes"]:
        rows = [["CLASS (x-priority)", "ROUTING PRIORITY", "SHED AT"]]
        for c in e["priority_classes"]:
            name = c["name"] + (" (default)" if c["default"] else "")
            shed = "never" if c["shed_at"] is None else f"{c['shed_at']:g}"
            rows.append([name, c["routing_priority"], shed])
        lines += ["", "priority classes", *_table(rows)]
    lines += ["", "in Envoy", *_table(_envoy_rows(e))]
    rows = [["KEY", "VALUE", "SOURCE"]]
    rows += [[key, entry["text"], entry["source"]] for key, entry in e["autoscaling"].items()]
    lines += ["", "autoscaling  (desired replicas; see docs/autoscaling.md)", *_table(rows)]
    lines += ["", "memory and placement", *_table(_memory_rows(e))]
    for v in e["versions"]:
        lines += ["", f"version {v['name']}  cluster {v['cluster']}  ({_version_status(v, e)})"]
        if v["source"] != "file":
            lines.append(
                f"  endpoints discovered from {v['source']} at run time: `cpctl endpoints list` shows them"
            )
        elif not v["endpoints"]:
            lines.append("  no endpoints")
        else:
            lines += _table(
                [["ADDRESS", "GPU", "GPU MEMORY", "CAPACITY", "EDS"], *map(_endpoint_row, v["endpoints"])]
            )
        if v.get("live") is not None:
            lines += _live_lines(v["live"])
    if e["warnings"]:
        lines += ["", "notes", *(f"  - {w}" for w in e["warnings"])]
    return "\n".join(lines) + "\n"


def render_json(e: Mapping[str, Any]) -> str:
    """The explanation for scripts: stable keys, durations in seconds, sizes in bytes and GB."""
    return json.dumps(e, indent=2) + "\n"


def render_yaml(e: Mapping[str, Any]) -> str:
    """The same document as render_json, as YAML (keys in the same order)."""
    import yaml

    return str(yaml.safe_dump(dict(e), sort_keys=False, default_flow_style=False, allow_unicode=True))


def render(e: Mapping[str, Any], fmt: str, config: str | None = None) -> str:
    """The explanation in an output format: table (text for people), json or yaml."""
    if fmt == "json":
        return render_json(e)
    if fmt == "yaml":
        return render_yaml(e)
    return render_text(e, config)
