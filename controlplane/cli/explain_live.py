"""The live state in `controlplane explain`: the fleet file cannot say how a rollout splits
a model's traffic, nor what its servers are doing; the control plane can.

`fetch_rollout()` asks the operator API (found, with its token, as cpctl finds them) for a
model's latest rollout, in cpctl's JSON form (`cpctl_output.rollout_to_dict`: the versions'
parts as `cpctl rollout status` names them); `fetch_loads()` for its endpoints' loads, as
`cpctl endpoints list -o json` gives them (a figure never read: None). The rest is pure:
which rollout decides the split, each version's share and role, the `rollout` and `loads`
sections of the explanation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.fleet.model import Model

# How long explain waits for the operator API: enough on loopback, short when nothing listens.
LIVE_DEADLINE_S = 0.5
RUNNING_PHASES = ("Progressing", "Paused")


@dataclass(frozen=True)
class LiveRollout:
    """What the operator API at `server` said about a model's rollout: `state` (cpctl's
    `rollout_to_dict`, with `summary` its one-line form), None if the model never had one; or
    `error`, why it could not be asked (then the rollout is unknown)."""

    server: str
    state: Mapping[str, Any] | None = None
    summary: str = ""
    error: str | None = None


@dataclass(frozen=True)
class LiveLoads:
    """What the operator API at `server` said about a model's endpoints: each as cpctl's
    `endpoint_to_dict` gives it (a figure never read: None); or `error`, why it could not be
    asked (then the loads are unknown)."""

    server: str
    endpoints: tuple[Mapping[str, Any], ...] = ()
    error: str | None = None


def _client(
    server: str | None, token_file: Path | None, env: Mapping[str, str] | None, timeout_s: float
) -> tuple[str, Any, str | None]:
    """(server, a cpctl Client or None, why not): the control plane and its token found as cpctl
    finds them (--server, else $CPCTL_SERVER, else the default address; client.resolve_token)."""
    from controlplane.admin.defaults import DEFAULT_ADMIN_LISTEN
    from controlplane.cli.cpctl_commands.client import Client, resolve_token
    from controlplane.cli.cpctl_commands.command import CliError

    env = os.environ if env is None else env
    # cpctl's order (client.server_address, which reads os.environ): flag, $CPCTL_SERVER, default.
    server = server or env.get("CPCTL_SERVER") or DEFAULT_ADMIN_LISTEN
    try:
        credential = resolve_token(token_file, env)
    except CliError as e:
        # cpctl's advice on where tokens come from follows the first clause; one line is enough.
        return server, None, f"no token to ask the control plane at {server} ({str(e).split('; ')[0]})"
    return server, Client(server, credential, timeout_s), None


def _rpc_error(e: Any, server: str, client: Any) -> str:
    """A failed call in one line: nobody answering, or cpctl's own line for the status."""
    import grpc

    from controlplane.cli.cpctl_commands.client import rpc_error_line

    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return f"no control plane answered at {server}"
    line, _ = rpc_error_line(e, server, client.token_source)
    return str(line).removeprefix("cpctl: ")


def fetch_rollout(
    model: str,
    server: str | None = None,
    token_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = LIVE_DEADLINE_S,
) -> LiveRollout:
    """Ask the control plane for `model`'s latest rollout, finding it and its token as cpctl
    does (--server, else $CPCTL_SERVER, else the default address; client.resolve_token). Never
    raises: a control plane that is not there, or refuses, is a LiveRollout with an error."""
    import grpc

    from controlplane.cli import cpctl_output as out
    from controlplane.v1 import rollout_pb2

    server, client, why = _client(server, token_file, env, timeout_s)
    if client is None:
        return LiveRollout(server, error=why)
    try:
        r = client.call(client.rollouts.Get, rollout_pb2.GetRolloutRequest(model=model))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND and "has no rollout" in (e.details() or ""):
            return LiveRollout(server)
        return LiveRollout(server, error=_rpc_error(e, server, client))
    finally:
        client.close()
    return LiveRollout(server, out.rollout_to_dict(r), out.summary_line(r))


def fetch_loads(
    model: str,
    server: str | None = None,
    token_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = LIVE_DEADLINE_S,
) -> LiveLoads:
    """Ask the control plane for the loads of `model`'s endpoints (`cpctl endpoints list
    --model`), found as fetch_rollout finds it. Never raises: an error says why not."""
    import grpc

    from controlplane.cli import cpctl_output as out
    from controlplane.v1 import endpoint_pb2

    server, client, why = _client(server, token_file, env, timeout_s)
    if client is None:
        return LiveLoads(server, error=why)
    try:
        r = client.call(client.endpoints.List, endpoint_pb2.ListEndpointsRequest(model=model))
    except grpc.RpcError as e:
        return LiveLoads(server, error=_rpc_error(e, server, client))
    finally:
        client.close()
    return LiveLoads(server, tuple(out.endpoint_to_dict(e) for e in r.endpoints))


# What explain shows of each endpoint's live state (cpctl's endpoint_to_dict keys).
LOAD_KEYS = (
    "address",
    "state",
    "weight",
    "running",
    "waiting",
    "kv_use",
    "in_flight",
    "latency_seconds",
    "error_rate",
    "signal_age_seconds",
    "sight",
    "note",
    "scrape_error",
    "scrape_error_reason",
)


def version_loads(version: str, loads: LiveLoads | None) -> list[dict[str, Any]] | None:
    """The version's endpoints as the control plane sees them now, in its order; None when it
    was not asked or could not be (the loads are unknown)."""
    if loads is None or loads.error is not None:
        return None
    return [{k: e.get(k) for k in LOAD_KEYS} for e in loads.endpoints if e.get("version") == version]


def loads_doc(loads: LiveLoads | None) -> dict[str, Any]:
    """The `loads` section: whether the control plane was asked for the endpoints' loads, and
    why it could not be (each version's `live` has what it said)."""
    if loads is None:
        return {"asked": False, "server": None, "error": None}
    return {"asked": True, "server": loads.server, "error": loads.error}


def live_split(model: Model, live: LiveRollout | None) -> tuple[Mapping[str, Any] | None, bool]:
    """(the rollout that decides how the model's traffic is split now, None if the file's
    stable takes it all; whether the split is unknown). Unknown when the control plane could
    not be asked, or when a finished rollout started from another stable than the file's (a
    completed rollout's canary stays stable until the file names it; an edit of the file's
    stable drops that: from the rollout alone, which of them serves cannot be told)."""
    if live is not None and live.error is not None:
        return None, True
    if live is None or live.state is None:
        return None, False
    r = live.state
    versions = {v.name for v in model.versions}
    named = {r["stable_version"], r["canary_version"], r.get("previous_version")} - {None}
    if not named <= versions:
        return None, False  # about versions the file no longer has
    if r["phase"] in RUNNING_PHASES:
        return r, False
    if started_from(r) == model.stable:
        return r, False  # Aborted: back on the file's stable; Completed: the file not updated yet
    if r["phase"] == "Completed" and r["stable_version"] == model.stable:
        return None, False  # the file names the new stable
    return None, True


def started_from(r: Mapping[str, Any]) -> str:
    """The stable version a rollout (cpctl's JSON form) started from: once Completed that is
    the version the new stable replaced."""
    return str(r["previous_version"] if r["phase"] == "Completed" else r["stable_version"])


def traffic_shares(model: Model, live: LiveRollout | None) -> dict[str, int] | None:
    """Each version's percent of the model's traffic (x-model-version aside); None when unknown."""
    r, unknown = live_split(model, live)
    if unknown:
        return None
    shares = {v.name: 100 if v.name == model.stable else 0 for v in model.versions}
    if r is not None and r["phase"] in RUNNING_PHASES:
        shares = {v: int(r["weights"].get(v, 0)) for v in shares}
    elif r is not None and r["phase"] == "Completed":
        shares = {v: 100 if v == r["stable_version"] else 0 for v in shares}
    return shares


def version_role(version: str, model: Model, live: LiveRollout | None) -> str:
    """stable (serves as the stable version), canary (a running rollout's), replaced (the old
    stable of a completed rollout, which the file still names), aborted (an aborted rollout's
    canary), unrouted (reached only with x-model-version), or unknown (a rollout may route to
    it, but how could not be told)."""
    r, unknown = live_split(model, live)
    if unknown:
        return "stable" if version == model.stable else "unknown"
    if r is None:
        return "stable" if version == model.stable else "unrouted"
    # The parts as cpctl shows them: once Completed, stable_version is the new stable.
    stable, canary, previous = r["stable_version"], r["canary_version"], r.get("previous_version")
    roles = {
        "Completed": {previous: "replaced", stable: "stable"},
        "Aborted": {canary: "aborted", stable: "stable"},
    }.get(r["phase"], {canary: "canary", stable: "stable"})
    return roles.get(version, "unrouted")


def rollout_doc(model: Model, live: LiveRollout | None) -> dict[str, Any]:
    """The `rollout` section: whether the control plane was asked, what it said (cpctl's JSON
    form), and `applies`: whether the versions' traffic and roles follow it."""
    if live is None:
        return {
            "asked": False,
            "server": None,
            "error": None,
            "state": None,
            "summary": None,
            "applies": False,
        }
    r, _ = live_split(model, live)
    return {
        "asked": True,
        "server": live.server,
        "error": live.error,
        "state": None if live.state is None else dict(live.state),
        "summary": live.summary or None,
        "applies": r is not None,
    }
