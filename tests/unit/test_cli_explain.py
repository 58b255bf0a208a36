"""`controlplane explain`: sources of each setting, memory and EDS placement, the Envoy side,
exit codes, the JSON shape, the live rollout and the endpoints' live loads; and the
conventions it shares with `check-config` and `import`: -o table|json|yaml, --config FILE,
`-` for standard input."""

from __future__ import annotations

import argparse
import io
import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from controlplane.cli import cpctl_output as out
from controlplane.cli.explain import (
    LIVE_DEADLINE_S,
    LiveLoads,
    LiveRollout,
    UnknownModel,
    explain,
    fetch_loads,
    fetch_rollout,
    render_text,
)
from controlplane.cli.main import main
from controlplane.fleet import FleetConfigInvalid, load_fleet, parse_fleet
from controlplane.v1 import endpoint_pb2, endpoint_pb2_grpc, rollout_pb2, rollout_pb2_grpc

FLEET = """\
listener: {port: 10000}
tiers:
  small:
    max_params_b: 15
    timeout: 30s
    retries: 3
    circuit_breakers: {default: {max_requests: 64}}
    outlier_detection: {consecutive_5xx: 2}
  large:
    timeout: 600s
    stream_idle_timeout: 20s
    max_body_bytes: 4096
gpu_classes:
  H100: {capacity: 1.0, memory_gb: 80}
  A100: {capacity: 0.6, memory_gb: 40}
models:
  chat:
    params_b: 8
    preferred_gpus: [H100]
    timeout: 10s
    circuit_breakers: {default: {max_pending: 8}}
    stable: v1
    versions:
      v1:
        endpoints:
          - {address: 127.0.10.1:8000, gpu: H100}
          - {address: 127.0.10.2:8000, gpu: A100, capacity: 0.5}
          - {address: 127.0.10.3:8000}
      v2:
        endpoints: [{address: 127.0.10.4:8000, gpu: H100}]
  big:
    params_b: 70
    dtype: int4
    tier: large
    max_body_bytes: 1000
    balancing: round_robin
    stable: v1
    versions:
      v1:
        endpoints:
          - {address: 10.0.1.1:8000, gpu: H100, gpu_memory_gb: 192}
          - {address: 10.0.1.2:8000, gpu: A100}
"""


NOT_ASKED = "the loads are not asked in these tests"


@pytest.fixture(autouse=True)
def no_live_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """explain asks the control plane for every model's loads: not whatever may listen on the
    default address while the unit tests run (the tests of fetch_loads put it back)."""
    import controlplane.cli.explain as explain_module

    def stub(model: str, server: str | None, token_file: Path | None) -> LiveLoads:
        return LiveLoads(server or "127.0.0.1:18001", error=NOT_ASKED)

    monkeypatch.setattr(explain_module, "fetch_loads", stub)


def explained(text: str, model: str, *, with_raw: bool = True) -> dict[str, Any]:
    fleet = parse_fleet(text, "fleet.yaml")
    return explain(fleet, model, yaml.safe_load(text) if with_raw else None)


def sources(e: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    return {k: (v["value"], v["source"]) for k, v in e["settings"].items()}


def test_each_setting_names_its_source() -> None:
    s = sources(explained(FLEET, "chat"))
    assert s["timeout"] == (10.0, "model")
    assert s["retries"] == (3, "tier")
    assert s["max_body_bytes"] == (8 << 20, "default")
    # One breaker key from the tier, its sibling from the model, the other priority built in.
    assert s["circuit_breakers.default.max_requests"] == (64, "tier")
    assert s["circuit_breakers.default.max_pending"] == (8, "model")
    assert s["circuit_breakers.high.max_requests"] == (1024, "default")
    assert s["outlier_detection.consecutive_5xx"] == (2, "tier")
    assert s["outlier_detection.interval"] == (5.0, "default")
    assert s["balancing"] == ("adaptive", "default")

    big = sources(explained(FLEET, "big"))
    assert big["timeout"] == (600.0, "tier")
    assert big["stream_idle_timeout"] == (20.0, "tier")
    assert big["max_body_bytes"] == (1000, "model")
    assert big["balancing"] == ("round_robin", "model")


def test_an_unset_idle_timeout_follows_the_timeout() -> None:
    e = explained(FLEET, "chat")
    idle = e["settings"]["stream_idle_timeout"]
    assert (idle["value"], idle["source"], idle["follows"]) == (10.0, "default", "timeout")
    assert e["envoy"]["route"]["idle_timeout_s"] == 10.0
    assert e["settings"]["timeout"]["follows"] is None


def test_a_key_set_to_the_inherited_value_still_counts_as_set() -> None:
    text = FLEET.replace("    timeout: 10s\n", "    timeout: 30s\n")  # the tier's value
    assert explained(text, "chat")["settings"]["timeout"]["source"] == "model"
    # Without the YAML only values can be compared, so it shows as inherited.
    assert explained(text, "chat", with_raw=False)["settings"]["timeout"]["source"] == "tier"
    assert explained(FLEET, "chat", with_raw=False)["settings"]["retries"]["source"] == "tier"


def test_tier_is_from_params_b_or_named() -> None:
    assert explained(FLEET, "chat")["tier"] == {
        "name": "small",
        "chosen_by": "params_b",
        "max_params_b": 15.0,
    }
    assert explained(FLEET, "big")["tier"] == {"name": "large", "chosen_by": "model", "max_params_b": None}


def test_memory_need_and_eds_placement() -> None:
    chat = explained(FLEET, "chat")
    assert chat["memory"]["need_gb"] == pytest.approx(19.2)  # 8B x 2 bytes (fp16) x 1.2
    assert chat["memory"]["source"] == "derived"
    v1 = {ep["address"]: ep for ep in chat["versions"][0]["endpoints"]}
    h100, a100, unknown = v1["127.0.10.1:8000"], v1["127.0.10.2:8000"], v1["127.0.10.3:8000"]
    assert (h100["eds_priority"], h100["placement"]) == (0, "preferred")
    assert (h100["gpu_memory_gb"], h100["gpu_memory_source"]) == (80, "gpu_class")
    assert (h100["capacity"], h100["capacity_source"]) == (1.0, "gpu_class")
    assert (a100["eds_priority"], a100["placement"]) == (1, "fallback")
    assert (a100["capacity"], a100["capacity_source"]) == (0.5, "endpoint")
    assert (unknown["eds_priority"], unknown["gpu_memory_source"]) == (1, "unknown")
    assert (unknown["capacity"], unknown["capacity_source"]) == (None, "learnt")

    big = explained(FLEET, "big")
    assert big["memory"]["need_gb"] == pytest.approx(42.0)  # 70B x 0.5 bytes (int4) x 1.2
    eps = {ep["address"]: ep for ep in big["versions"][0]["endpoints"]}
    assert (eps["10.0.1.1:8000"]["eds_priority"], eps["10.0.1.1:8000"]["placement"]) == (0, "primary")
    assert eps["10.0.1.1:8000"]["gpu_memory_source"] == "endpoint"
    left = eps["10.0.1.2:8000"]
    assert (left["eds_priority"], left["placement"]) == (None, "left out")
    assert left["reason"] == "needs 42 GB, has 40 GB"


def test_declared_memory_wins_over_the_derived_one() -> None:
    text = FLEET.replace("    dtype: int4\n", "    memory_gb: 30\n")
    big = explained(text, "big")
    assert (big["memory"]["need_gb"], big["memory"]["source"]) == (30, "memory_gb")
    assert [ep["eds_priority"] for ep in big["versions"][0]["endpoints"]] == [0, 0]


def test_text_shows_sources_and_placement_lines() -> None:
    text = render_text(explained(FLEET, "big"), "fleet.yaml")
    lines = text.splitlines()
    assert lines[0] == "model big  (fleet.yaml)"
    assert any(line.split() == ["max_body_bytes", "1000", "model"] for line in lines), text
    assert any(line.split()[:3] == ["timeout", "600s", "tier"] for line in lines), text
    assert "need            42 GB, 70B parameters x 0.5 bytes (int4) x 1.2" in text
    row = next(line for line in lines if line.strip().startswith("10.0.1.2:8000"))
    assert row.split() == [
        "10.0.1.2:8000",
        "A100",
        "40",
        "GB",
        "(class)",
        "0.6",
        "(class)",
        "left",
        "out:",
        "needs",
        "42",
        "GB,",
        "has",
        "40",
        "GB",
    ]
    # Columns are aligned: each endpoint row starts its EDS column at the header's.
    header = next(line for line in lines if line.strip().startswith("ADDRESS"))
    assert row.index("left out") == header.index("EDS")

    chat = render_text(explained(FLEET, "chat"))
    assert "unset: follows the timeout" in chat
    assert "priority 0 (preferred)" in chat
    assert "learnt at run time" in chat


def test_envoy_side_is_read_from_the_generated_resources() -> None:
    e = explained(FLEET, "chat")["envoy"]
    assert e["cluster"] == "chat@v1"
    assert e["route"] == {"timeout_s": 10.0, "idle_timeout_s": 10.0, "routing_priority": "default"}
    retry = e["retry"]
    assert retry["num_retries"] == 3
    assert retry["retry_on"] == ["connect-failure", "refused-stream", "reset"]
    assert retry["retriable_status_codes"] == [507]
    assert retry["other_host"] is True
    assert retry["next_priority_after_attempts"] == 2
    assert e["circuit_breakers"]["default"] == {
        "max_requests": 64,
        "max_pending": 8,
        "retry_budget": {"percent": 50.0, "min_concurrency": 16},
    }
    assert e["outlier_detection"]["consecutive_5xx"] == 2
    assert e["outlier_detection"]["local_origin_errors_count"] is True
    assert e["healthy_panic_threshold_percent"] == 0.0
    assert e["load_balancer"] == "least_request"
    # The model's own limit for x-model requests; the listener's (largest of any model) otherwise.
    assert e["body_limit"]["header_routed_bytes"] == 8 << 20
    assert e["body_limit"]["body_routed_bytes"] == 8 << 20
    assert e["proxyless_grpc"] == {"timeout_s": 10.0, "idle_timeout_s": None, "retries": 3}

    big = explained(FLEET, "big")
    assert big["envoy"]["body_limit"]["header_routed_bytes"] == 1000
    assert big["envoy"]["body_limit"]["body_routed_bytes"] == 8 << 20
    assert big["envoy"]["load_balancer"] == "round_robin"
    assert any("listener-wide 8388608" in w for w in big["warnings"])
    assert any("non-streamed completion that takes longer than 20s" in w for w in big["warnings"])


def test_retries_too_few_to_reach_the_fallback_are_flagged() -> None:
    assert explained(FLEET, "chat")["failover"]["retries_reach_fallback"] is True
    one = explained(FLEET.replace("    retries: 3\n", "    retries: 1\n"), "chat")
    assert one["failover"] == {
        "has_fallback": True,
        "retries_reach_fallback": False,
        "held_out_after_scrapes": 3,
        "held_out_after_s": 3.0,
    }
    assert any(w.startswith("retries 1: no retry reaches the fallback priority") for w in one["warnings"])
    none = explained(FLEET.replace("    retries: 3\n", "    retries: 0\n"), "chat")
    assert none["envoy"]["retry"] is None
    assert any(w.startswith("retries 0: no retry policy") for w in none["warnings"])


def test_a_stable_version_with_nothing_that_fits_is_flagged() -> None:
    # v2's big endpoint keeps the config valid; the stable v1 has only servers too small.
    text = FLEET.replace("          - {address: 10.0.1.1:8000, gpu: H100, gpu_memory_gb: 192}\n", "").replace(
        "          - {address: 10.0.1.2:8000, gpu: A100}\n",
        "          - {address: 10.0.1.2:8000, gpu: A100}\n"
        "      v2:\n        endpoints: [{address: 10.0.1.3:8000, gpu_memory_gb: 192}]\n",
    )
    # The loader now refuses it outright, naming the stable version.
    with pytest.raises(
        FleetConfigInvalid, match=r"models\.big\.versions\.v1: the stable version's endpoints"
    ):
        parse_fleet(text)


def test_a_second_breaker_threshold_in_cluster_overrides_is_flagged() -> None:
    text = FLEET.replace(
        "    balancing: round_robin\n",
        "    balancing: round_robin\n"
        "    cluster_overrides: {circuit_breakers: {thresholds: [{priority: DEFAULT, max_requests: 5}]}}\n",
    )
    e = explained(text, "big")
    assert e["envoy"]["circuit_breakers"]["default"]["max_requests"] == 1024  # the first one, Envoy's pick
    assert any("second default-priority circuit-breaker threshold" in w for w in e["warnings"])


def test_priority_classes_are_listed() -> None:
    text = FLEET + (
        "priority_classes:\n  premium: {routing_priority: high}\n  standard: {shed_at: 0.9}\n"
        "default_priority_class: standard\n"
    )
    e = explained(text, "chat")
    assert e["priority_classes"] == [
        {"name": "premium", "default": False, "routing_priority": "high", "shed_at": None},
        {"name": "standard", "default": True, "routing_priority": "default", "shed_at": 0.9},
    ]
    assert e["envoy"]["route"]["routing_priority"] == "default"  # requests without x-priority
    out = render_text(e)
    assert any(line.split() == ["standard", "(default)", "default", "0.9"] for line in out.splitlines()), out
    assert explained(FLEET, "chat")["priority_classes"] == []


def test_affinity_shows_with_its_hashing_load_balancer() -> None:
    text = FLEET.replace("    balancing: round_robin\n", "    affinity: {header: x-session-id}\n")
    e = explained(text, "big")
    assert e["affinity"] == {
        "header": "x-session-id",
        "body_field": None,
        "adapter": False,
        "algorithm": "maglev",
        "balance_factor": 150,
    }
    assert e["envoy"]["load_balancer"] == "maglev"
    assert "maglev on the header x-session-id, bounded at 150% of mean load" in render_text(e)
    assert explained(FLEET, "chat")["affinity"] is None


def test_unknown_model_raises_with_the_known_ones() -> None:
    with pytest.raises(UnknownModel) as err:
        explained(FLEET, "nope")
    assert err.value.known == ["chat", "big"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return path


def test_cli_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, FLEET)
    assert main(["explain", "chat", "--config", str(path), "--offline"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"model chat  ({path})\n")
    assert "cluster chat@v1 takes all traffic" in out
    assert "  rollout   not asked (--offline); `cpctl rollout status chat` shows it\n" in out
    assert "version v2  cluster chat@v2  (not stable: only requests with x-model-version: v2 reach it)" in out


def test_cli_unknown_model_exits_2_naming_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, FLEET)
    assert main(["explain", "llama", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "unknown model 'llama'; known models: chat, big" in captured.err


def test_cli_invalid_config_exits_1_with_every_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, FLEET.replace("stable: v1", "stable: v9"))
    assert main(["explain", "chat", "--config", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "models.chat.stable: names version 'v9'" in captured.err
    assert "models.big.stable: names version 'v9'" in captured.err
    assert captured.err.rstrip().endswith("2 error(s)")

    assert main(["explain", "chat", "--config", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read file" in capsys.readouterr().err


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, FLEET)
    assert main(["explain", "big", "--config", str(path), "--format", "json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert list(data) == [
        "schema",
        "model",
        "tier",
        "params_b",
        "protocol",
        "stable",
        "cluster",
        "settings",
        "priority_classes",
        "affinity",
        "envoy",
        "autoscaling",
        "memory",
        "failover",
        "rollout",
        "loads",
        "versions",
        "warnings",
    ]
    assert data["loads"] == {"asked": True, "server": "127.0.0.1:18001", "error": NOT_ASKED}
    assert [v["live"] for v in data["versions"]] == [None]
    assert data["schema"] == 1
    assert data["settings"]["max_body_bytes"] == {
        "value": 1000,
        "text": "1000",
        "source": "model",
        "follows": None,
    }
    assert data["memory"]["need_gb"] == 42
    endpoints = data["versions"][0]["endpoints"]
    assert set(endpoints[0]) == {
        "address",
        "gpu",
        "gpu_memory_gb",
        "gpu_memory_source",
        "capacity",
        "capacity_source",
        "eds_priority",
        "placement",
        "reason",
    }
    assert [ep["eds_priority"] for ep in endpoints] == [0, None]
    # Stable: the same input gives the same bytes.
    assert main(["explain", "big", "--config", str(path), "--format", "json"]) == 0
    assert capsys.readouterr().out == out


def test_autoscaling_shows_each_effective_value_and_its_source(tmp_path: Path) -> None:
    text = FLEET_AUTOSCALING
    path = write(tmp_path, text)
    fleet = load_fleet(path)
    raw = yaml.safe_load(text)
    a = explain(fleet, "m", raw)["autoscaling"]
    assert a["min"] == {"value": 0, "text": "0", "source": "tier"}
    assert a["max"] == {"value": 3, "text": "3", "source": "model"}
    assert a["stable_window"]["text"] == "30s" and a["stable_window"]["source"] == "tier"
    assert a["panic_threshold"]["source"] == "default"
    assert a["target_per_replica"]["value"] is None and "learnt" in a["target_per_replica"]["text"]
    assert "autoscaling" in render_text(explain(fleet, "m", raw))


FLEET_AUTOSCALING = """\
listener: {port: 10000}
tiers:
  small: {autoscaling: {min: 0, stable_window: 30s}}
models:
  m:
    params_b: 1
    stable: v1
    autoscaling: {max: 3}
    versions: {v1: {endpoints: ["127.0.0.1:8000"]}}
"""


def test_a_discovered_version_says_where_its_endpoints_come_from(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from controlplane.cli.explain import explain, render_text
    from controlplane.fleet import parse_fleet

    text = (
        "listener: {port: 10000}\ntiers: {small: {max_params_b: 15}}\nmodels:\n  m:\n    params_b: 8\n"
        "    stable: v1\n    versions:\n      v1: {discover: {srv: _http._tcp.m.models.test}}\n"
    )
    e = explain(parse_fleet(text), "m")
    assert e["versions"][0]["source"] == "srv:_http._tcp.m.models.test"
    assert "discovered from srv:_http._tcp.m.models.test" in render_text(e)
    assert not any("no endpoints" in w for w in e["warnings"])


# ---------------------------------------------------------------------------------------------
# output formats, --config, standard input


def stdin_of(monkeypatch: pytest.MonkeyPatch, text: str | bytes) -> None:
    data = text.encode() if isinstance(text, str) else text
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


@pytest.mark.parametrize(
    "flags",
    [[], ["-o", "table"], ["--output", "table"], ["--format", "text"], ["--format", "table"]],
)
def test_explain_table_whichever_way_it_is_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    path = write(tmp_path, FLEET)
    assert main(["explain", "big", "--config", str(path), *flags]) == 0
    assert capsys.readouterr().out.startswith(f"model big  ({path})\n  tier ")


@pytest.mark.parametrize(
    ("flags", "load"),
    [
        (["-o", "json"], json.loads),
        (["--output", "json"], json.loads),
        (["--format", "json"], json.loads),
        (["-o", "json", "--format", "json"], json.loads),
        (["-o", "yaml"], yaml.safe_load),
        (["--output", "yaml"], yaml.safe_load),
        (["--format", "yaml"], yaml.safe_load),
    ],
)
def test_explain_json_and_yaml_are_the_same_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], load: Any
) -> None:
    path = write(tmp_path, FLEET)
    assert main(["explain", "chat", "--config", str(path), "--offline", "-o", "json"]) == 0
    reference = json.loads(capsys.readouterr().out)
    assert main(["explain", "chat", "--config", str(path), "--offline", *flags]) == 0
    out = capsys.readouterr().out
    assert load(out) == reference
    assert list(load(out)) == list(reference)  # keys in the same order


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-o", "json", "--format", "text"], "-o json and --format text disagree"),
        (["-o", "table", "--format", "yaml"], "-o table and --format yaml disagree"),
    ],
)
def test_explain_formats_that_disagree_are_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    path = write(tmp_path, FLEET)
    assert main(["explain", "big", "--config", str(path), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err


@pytest.mark.parametrize("command", [["explain", "big", "--config", "f.yaml"], ["check-config", "f.yaml"]])
def test_an_unknown_output_format_exits_2(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([*command, "-o", "xml"])
    assert e.value.code == 2
    assert "argument -o/--output: invalid choice: 'xml'" in capsys.readouterr().err


def test_explain_reads_standard_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stdin_of(monkeypatch, FLEET)
    assert main(["explain", "big", "--config", "-"]) == 0
    assert capsys.readouterr().out.startswith("model big  (<stdin>)\n")
    stdin_of(monkeypatch, FLEET.replace("stable: v1", "stable: v9"))
    assert main(["explain", "big", "--config", "-"]) == 1
    err = capsys.readouterr().err
    assert "<stdin>:" in err and "models.big.stable: names version 'v9'" in err
    assert err.rstrip().endswith("<stdin>: 2 error(s)")


def test_check_config_positional_and_config_are_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, FLEET)
    outputs = []
    for argv in (
        ["check-config", str(path)],
        ["check-config", "--config", str(path)],
        ["check-config", str(path), "--config", str(path)],
    ):
        assert main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[0].startswith(f"{path}: ok: 2 tiers, 2 models, 6 endpoints\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check-config"], "give the fleet file: --config FILE (- for stdin)"),
        (["check-config", "a.yaml", "--config", "b.yaml"], "give the fleet file once: FILE or --config FILE"),
    ],
)
def test_check_config_without_one_file_is_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_check_config_json_of_a_valid_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, FLEET)
    assert main(["check-config", "--config", str(path), "-o", "json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    doc = json.loads(captured.out)
    assert doc == {
        "file": str(path),
        "valid": True,
        "errors": [],
        "summary": {
            "tiers": 2,
            "endpoints": 6,
            "models": [
                {"name": "chat", "tier": "small", "stable": "v1", "versions": ["v1", "v2"]},
                {"name": "big", "tier": "large", "stable": "v1", "versions": ["v1"]},
            ],
        },
    }


@pytest.mark.parametrize(("fmt", "load"), [("json", json.loads), ("yaml", yaml.safe_load)])
def test_check_config_lists_every_error_with_file_line_field_and_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str, load: Any
) -> None:
    path = write(tmp_path, FLEET.replace("stable: v1", "stable: v9").replace("retries: 3", "retries: many"))
    assert main(["check-config", str(path), "-o", fmt]) == 1  # the exit code of the table form
    captured = capsys.readouterr()
    assert captured.err == ""
    doc = load(captured.out)
    assert doc["file"] == str(path) and doc["valid"] is False and doc["summary"] is None
    assert {"file": str(path), "line": 6, "field": "tiers.small.retries"} == {
        k: v for k, v in doc["errors"][0].items() if k != "message"
    }
    assert doc["errors"][0]["message"].startswith("expected")
    fields = [e["field"] for e in doc["errors"]]
    assert "models.chat.stable" in fields and "models.big.stable" in fields
    assert all(set(e) == {"file", "line", "field", "message"} for e in doc["errors"])
    # The table form says the same, one line each, on stderr.
    assert main(["check-config", str(path)]) == 1
    assert capsys.readouterr().err.count("\n") == len(doc["errors"]) + 1


def test_check_config_json_of_a_file_that_cannot_be_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.yaml"
    assert main(["check-config", str(missing), "--output", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] is False
    [error] = doc["errors"]
    assert error["file"] == str(missing) and error["line"] is None and error["field"] == ""
    assert error["message"].startswith("cannot read file")


def test_check_config_reads_standard_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stdin_of(monkeypatch, FLEET)
    assert main(["check-config", "-"]) == 0
    assert capsys.readouterr().out.startswith("<stdin>: ok: 2 tiers, 2 models, 6 endpoints\n")
    stdin_of(monkeypatch, FLEET.replace("stable: v1", "stable: v9"))
    assert main(["check-config", "--config", "-", "-o", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["file"] == "<stdin>" and {e["file"] for e in doc["errors"]} == {"<stdin>"}
    assert [e["line"] for e in doc["errors"]] == [22, 37]
    stdin_of(monkeypatch, b"\xff not utf-8")
    assert main(["check-config", "-"]) == 1
    assert "<stdin>:1: <top>: not UTF-8 text" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--config", "--from"])
def test_import_takes_the_fleet_file_as_config_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    path = write(tmp_path, FLEET)
    # A bad --to is refused before anything is read or written: only the spelling is tested.
    assert main(["import", flag, str(path), "--to", "http://127.0.0.1:1"]) == 2
    assert "controlplane import: --to:" in capsys.readouterr().err


def test_serve_refuses_standard_input_as_its_watched_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", "-"]) == 2
    assert "serve watches a file; standard input (-) is not one" in capsys.readouterr().err


def test_every_subcommand_that_reads_a_fleet_file_takes_config() -> None:
    from controlplane.cli.main import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    readers = {"serve", "check-config", "explain", "import"}
    for name in readers:
        flags = {s for a in sub.choices[name]._actions for s in a.option_strings}
        assert "--config" in flags, name
    for name in ("explain", "check-config"):
        flags = {s for a in sub.choices[name]._actions for s in a.option_strings}
        assert {"-o", "--output"} <= flags, name


# ---------------------------------------------------------------------------------------------
# the live rollout


def live(
    phase: str, stable: str = "v1", canary: str = "v2", weights: dict[str, int] | None = None
) -> LiveRollout:
    """What fetch_rollout makes of the server's rollout from `stable` to `canary` (as the
    server names them: where it started and where it went), in cpctl's JSON form."""
    r = rollout_pb2.Rollout(
        model="chat",
        phase=phase,
        step=1,
        steps=[20, 50, 100],
        weights=weights if weights is not None else {stable: 80, canary: 20},
        stable_version=stable,
        canary_version=canary,
    )
    return LiveRollout("127.0.0.1:18001", out.rollout_to_dict(r), out.summary_line(r))


def traffic(e: dict[str, Any]) -> dict[str, tuple[str, int | None]]:
    return {v["name"]: (v["role"], v["traffic_percent"]) for v in e["versions"]}


FLEET3 = FLEET.replace(
    "      v2:\n        endpoints: [{address: 127.0.10.4:8000, gpu: H100}]\n",
    "      v2:\n        endpoints: [{address: 127.0.10.4:8000, gpu: H100}]\n"
    "      v3:\n        endpoints: [{address: 127.0.10.5:8000, gpu: H100}]\n",
)


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (None, {"v1": ("stable", 100), "v2": ("unrouted", 0), "v3": ("unrouted", 0)}),
        (LiveRollout("s"), {"v1": ("stable", 100), "v2": ("unrouted", 0), "v3": ("unrouted", 0)}),
        (
            LiveRollout("s", error="no control plane answered at s"),
            {"v1": ("stable", None), "v2": ("unknown", None), "v3": ("unknown", None)},
        ),
        (live("Progressing"), {"v1": ("stable", 80), "v2": ("canary", 20), "v3": ("unrouted", 0)}),
        (live("Paused"), {"v1": ("stable", 80), "v2": ("canary", 20), "v3": ("unrouted", 0)}),
        (
            live("Progressing", weights={"v1": 0, "v2": 100}),  # finishing: the old stable leaves
            {"v1": ("stable", 0), "v2": ("canary", 100), "v3": ("unrouted", 0)},
        ),
        (
            live("Completed", weights={"v1": 0, "v2": 100}),  # the file still says stable: v1
            {"v1": ("replaced", 0), "v2": ("stable", 100), "v3": ("unrouted", 0)},
        ),
        (
            live("Aborted", weights={"v1": 100, "v2": 0}),
            {"v1": ("stable", 100), "v2": ("aborted", 0), "v3": ("unrouted", 0)},
        ),
        (
            # An undo after a completed v1 -> v2 the file has not caught up with: v2 is stable.
            live("Progressing", stable="v2", canary="v1", weights={"v2": 50, "v1": 50}),
            {"v1": ("canary", 50), "v2": ("stable", 50), "v3": ("unrouted", 0)},
        ),
        (
            # Completed, and the file names the new stable: the file says it all.
            live("Completed", stable="v3", canary="v1", weights={"v3": 0, "v1": 100}),
            {"v1": ("stable", 100), "v2": ("unrouted", 0), "v3": ("unrouted", 0)},
        ),
        (
            # Ended from another stable than the file's: which one serves cannot be told.
            live("Aborted", stable="v2", canary="v3", weights={"v2": 100, "v3": 0}),
            {"v1": ("stable", None), "v2": ("unknown", None), "v3": ("unknown", None)},
        ),
        (
            live("Completed", stable="v2", canary="v3", weights={"v2": 0, "v3": 100}),
            {"v1": ("stable", None), "v2": ("unknown", None), "v3": ("unknown", None)},
        ),
        (
            # About a version the file no longer has.
            live("Completed", stable="v0", canary="v1", weights={"v0": 0, "v1": 100}),
            {"v1": ("stable", 100), "v2": ("unrouted", 0), "v3": ("unrouted", 0)},
        ),
    ],
)
def test_the_live_rollout_decides_each_versions_role_and_traffic(
    state: LiveRollout | None, expected: dict[str, tuple[str, int | None]]
) -> None:
    e = explained_live(FLEET3, state)
    assert traffic(e) == expected
    assert e["rollout"]["asked"] is (state is not None)
    text = render_text(e)
    for v in e["versions"]:
        assert f"version {v['name']}  cluster chat@{v['name']}  (" in text
    assert "no route sends it traffic" not in text


def explained_live(text: str, state: LiveRollout | None) -> dict[str, Any]:
    fleet = parse_fleet(text, "fleet.yaml")
    return explain(fleet, "chat", yaml.safe_load(text), state)


def lines_of(e: dict[str, Any]) -> list[str]:
    return render_text(e).splitlines()


def test_text_mid_rollout_shows_phase_step_and_split() -> None:
    lines = lines_of(explained_live(FLEET, live("Progressing")))
    assert "  stable    v1  (cluster chat@v1 takes 80% of the traffic while the rollout runs)" in lines
    assert (
        "  rollout   Progressing, step 1/3 (20%), v1 80%, v2 20%  (live from 127.0.0.1:18001; "
        "`cpctl rollout status chat`)"
    ) in lines
    assert "version v1  cluster chat@v1  (stable: 80% of the traffic)" in lines
    assert "version v2  cluster chat@v2  (canary of the running rollout: 20% of the traffic)" in lines


def test_text_when_the_control_plane_cannot_be_asked_says_so_in_one_line() -> None:
    e = explained_live(
        FLEET, LiveRollout("127.0.0.1:18001", error="no control plane answered at 127.0.0.1:18001")
    )
    lines = lines_of(e)
    rollout = [line for line in lines if line.startswith("  rollout ")]
    assert rollout == [
        "  rollout   unknown: no control plane answered at 127.0.0.1:18001; "
        "`cpctl rollout status chat` shows it"
    ]
    assert (
        "version v2  cluster chat@v2  (not stable in the file; a rollout may send it traffic: "
        "see rollout above)" in lines
    )
    assert e["rollout"] == {
        "asked": True,
        "server": "127.0.0.1:18001",
        "error": "no control plane answered at 127.0.0.1:18001",
        "state": None,
        "summary": None,
        "applies": False,
    }


def test_text_after_a_completed_rollout_the_file_has_not_caught_up_with() -> None:
    lines = lines_of(explained_live(FLEET, live("Completed", weights={"v1": 0, "v2": 100})))
    assert "  stable    v1  (in the file; v2 replaced it: its rollout completed)" in lines
    assert (
        "version v2  cluster chat@v2  (stable since its rollout completed: takes the traffic "
        "(the file says stable: v1))"
    ) in lines
    assert any(
        line.startswith("version v1  cluster chat@v1  (replaced by the completed rollout") for line in lines
    )


def test_text_with_no_rollout_and_with_an_ambiguous_one() -> None:
    lines = lines_of(explained_live(FLEET, LiveRollout("127.0.0.1:18001")))
    assert "  rollout   none  (asked the control plane at 127.0.0.1:18001)" in lines
    assert (
        "version v2  cluster chat@v2  (not stable: only requests with x-model-version: v2 reach it)" in lines
    )
    e = explained_live(FLEET3, live("Aborted", stable="v2", canary="v3", weights={"v2": 100, "v3": 0}))
    rollout = next(line for line in lines_of(e) if line.startswith("  rollout "))
    assert "it started from v2, not the file's stable v1: `cpctl endpoints list --model chat`" in rollout
    assert e["rollout"]["applies"] is False
    # Completed: cpctl's JSON names v3 stable and v2 the one it replaced; it started from v2.
    e = explained_live(FLEET3, live("Completed", stable="v2", canary="v3", weights={"v2": 0, "v3": 100}))
    rollout = next(line for line in lines_of(e) if line.startswith("  rollout "))
    assert "it started from v2, not the file's stable v1" in rollout
    assert (e["rollout"]["state"]["stable_version"], e["rollout"]["state"]["previous_version"]) == (
        "v3",
        "v2",
    )


def test_a_single_version_model_never_asks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import controlplane.cli.explain as explain_module

    asked: list[tuple[str, str | None, Path | None]] = []

    def fetch(model: str, server: str | None, token_file: Path | None) -> LiveRollout:
        asked.append((model, server, token_file))
        return live("Progressing")

    monkeypatch.setattr(explain_module, "fetch_rollout", fetch)
    path = write(tmp_path, FLEET)
    assert main(["explain", "big", "--config", str(path)]) == 0
    assert main(["explain", "chat", "--config", str(path), "--offline"]) == 0
    assert asked == []
    argv = ["explain", "chat", "--config", str(path), "--server", "127.0.0.1:5", "--token-file", "t"]
    assert main(argv) == 0
    assert asked == [("chat", "127.0.0.1:5", Path("t"))]


# ---- fetch_rollout against a real gRPC server on loopback ----------------------------------


class FakeRollouts(rollout_pb2_grpc.RolloutServiceServicer):
    """The operator API's Get, enough for explain: one model mid-rollout, one without any."""

    def Get(
        self, request: rollout_pb2.GetRolloutRequest, context: grpc.ServicerContext
    ) -> rollout_pb2.Rollout:
        if dict(context.invocation_metadata()).get("authorization") != "Bearer secret":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "the token is not valid")
        if request.model == "chat":
            return rollout_pb2.Rollout(
                model="chat",
                stable_version="v1",
                canary_version="v2",
                phase="Progressing",
                step=2,
                steps=[20, 50, 100],
                weights={"v1": 50, "v2": 50},
            )
        if request.model == "big":
            context.abort(
                grpc.StatusCode.NOT_FOUND, "model big has no rollout; start one with `cpctl rollout start`"
            )
        context.abort(
            grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r} (the fleet has: chat, big)"
        )
        raise AssertionError("unreachable")


NO_DIALECT = (
    "unreadable metrics page: no vLLM, SGLang, TGI, Triton or llama.cpp metrics on the page "
    "(15 samples; expected names starting with 'vllm:', ...)"
)


def chat_endpoints() -> list[endpoint_pb2.Endpoint]:
    """chat's endpoints as the operator API lists them: one whose page is of no known dialect
    (nothing read), one llama.cpp server under load (no KV gauge), one of v2 idle."""
    return [
        endpoint_pb2.Endpoint(
            model="chat", version="v1", address="127.0.10.1:8000", state="SERVING", weight=100, sight="SEEN",
            signal_age_seconds=-1, scrape_error=NO_DIALECT, scrape_error_reason="no_dialect",
        ),
        endpoint_pb2.Endpoint(
            model="chat", version="v1", address="127.0.10.2:8000", state="SERVING", weight=40, sight="SEEN",
            running=4, waiting=4, in_flight=4, error_rate=0, signal_age_seconds=0.5,
        ),
        endpoint_pb2.Endpoint(
            model="chat", version="v2", address="127.0.10.4:8000", state="SERVING", weight=100, sight="SEEN",
            running=0, waiting=0, kv_use=0, in_flight=0, latency_seconds=0.25, error_rate=0,
            signal_age_seconds=0.5,
        ),
    ]  # fmt: skip


class FakeEndpoints(endpoint_pb2_grpc.EndpointServiceServicer):
    """The operator API's List, enough for explain."""

    def List(
        self, request: endpoint_pb2.ListEndpointsRequest, context: grpc.ServicerContext
    ) -> endpoint_pb2.ListEndpointsResponse:
        if dict(context.invocation_metadata()).get("authorization") != "Bearer secret":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "the token is not valid")
        if request.model not in ("chat", "big"):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}")
        return endpoint_pb2.ListEndpointsResponse(
            endpoints=[e for e in chat_endpoints() if e.model == request.model]
        )


@pytest.fixture(scope="module")
def operator_api() -> Iterator[str]:
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(FakeRollouts(), server)
    endpoint_pb2_grpc.add_EndpointServiceServicer_to_server(FakeEndpoints(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once it is closed


def test_fetch_rollout_reads_the_live_state(operator_api: str) -> None:
    got = fetch_rollout("chat", operator_api, env={"CPCTL_TOKEN": "secret"})
    assert got.error is None and got.server == operator_api
    assert got.state is not None and got.state["phase"] == "Progressing"
    assert got.state["weights"] == {"v1": 50, "v2": 50}
    assert got.summary == "chat: Progressing, step 2/3 (50%), v1 50%, v2 50%"


def test_fetch_rollout_finds_server_and_token_as_cpctl_does(operator_api: str, tmp_path: Path) -> None:
    token = tmp_path / "admin-token"
    token.write_text("secret\n")
    token.chmod(0o600)
    env = {"CPCTL_SERVER": operator_api, "CPCTL_TOKEN_FILE": str(token)}
    assert fetch_rollout("chat", env=env).state is not None
    assert fetch_rollout("chat", token_file=token, env={"CPCTL_SERVER": operator_api}).state is not None


@pytest.mark.parametrize(
    ("model", "env", "error"),
    [
        ("big", {"CPCTL_TOKEN": "secret"}, None),  # no rollout: a known answer, not an error
        ("nope", {"CPCTL_TOKEN": "secret"}, "NOT_FOUND: unknown model 'nope'"),
        ("chat", {"CPCTL_TOKEN": "wrong"}, "UNAUTHENTICATED: the token is not valid"),
        ("chat", {"CPCTL_TOKEN_FILE": "/nonexistent/admin-token"}, "no token to ask the control plane at"),
    ],
)
def test_fetch_rollout_answers(operator_api: str, model: str, env: dict[str, str], error: str | None) -> None:
    got = fetch_rollout(model, operator_api, env=env)
    assert got.state is None
    if error is None:
        assert got.error is None
    else:
        assert got.error is not None and error in got.error and "\n" not in got.error


def test_fetch_rollout_is_quick_when_nothing_listens() -> None:
    server = closed_port()
    started = time.monotonic()
    got = fetch_rollout("chat", server, env={"CPCTL_TOKEN": "secret"})
    assert got.error == f"no control plane answered at {server}"
    assert time.monotonic() - started < 2 * LIVE_DEADLINE_S + 0.5


def test_explain_cli_against_the_operator_api(
    operator_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CPCTL_TOKEN", "secret")
    monkeypatch.delenv("CPCTL_TOKEN_FILE", raising=False)
    path = write(tmp_path, FLEET)
    assert main(["explain", "chat", "--config", str(path), "--server", operator_api]) == 0
    out = capsys.readouterr().out
    assert f"  rollout   Progressing, step 2/3 (50%), v1 50%, v2 50%  (live from {operator_api}; " in out
    assert "version v2  cluster chat@v2  (canary of the running rollout: 50% of the traffic)" in out
    monkeypatch.setenv("CPCTL_SERVER", closed_port())
    assert main(["explain", "chat", "--config", str(path), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rollout"]["error"].startswith("no control plane answered at 127.0.0.1:")
    assert [v["traffic_percent"] for v in doc["versions"]] == [None, None]


# ---- the endpoints' live loads ---------------------------------------------------------------


def chat_loads() -> LiveLoads:
    return LiveLoads("127.0.0.1:18001", tuple(out.endpoint_to_dict(e) for e in chat_endpoints()))


def test_live_loads_show_unknown_never_zero_and_why_a_page_reads_no_load() -> None:
    fleet = parse_fleet(FLEET, "fleet.yaml")
    e = explain(fleet, "chat", yaml.safe_load(FLEET), None, chat_loads())
    assert e["loads"] == {"asked": True, "server": "127.0.0.1:18001", "error": None}
    v1, v2 = e["versions"]
    assert [x["address"] for x in v1["live"]] == ["127.0.10.1:8000", "127.0.10.2:8000"]
    assert [x["address"] for x in v2["live"]] == ["127.0.10.4:8000"]
    never, busy = v1["live"]
    figures = ("running", "waiting", "kv_use", "latency_seconds", "error_rate")
    assert [never[k] for k in figures] == [None] * 5
    assert [busy[k] for k in figures] == [4, 4, None, None, 0]
    assert (never["scrape_error"], never["scrape_error_reason"]) == (NO_DIALECT, "no_dialect")
    assert json.loads(json.dumps(e))["versions"][0]["live"][0]["kv_use"] is None
    lines = lines_of(e)
    assert (
        "  loads     live from 127.0.0.1:18001, per version below  (`cpctl endpoints list --model chat`)"
        in lines
    )
    live_rows = [line.split() for line in lines if line.startswith("  127.0.10.") and "SERVING" in line]
    assert live_rows[0] == [
        "127.0.10.1:8000",
        "SERVING",
        "100",
        *["unknown"] * 3,
        "0",
        *["unknown"] * 2,
        "never",
        "read",
    ]
    assert live_rows[1] == [
        "127.0.10.2:8000",
        "SERVING",
        "40",
        "4",
        "4",
        "unknown",
        "4",
        "unknown",
        "0.00%",
        "500ms",
    ]
    assert live_rows[2] == [
        "127.0.10.4:8000",
        "SERVING",
        "100",
        "0",
        "0",
        "0.00%",
        "0",
        "250ms",
        "0.00%",
        "500ms",
    ]
    assert f"  - 127.0.10.1:8000: last scrape read no load (no_dialect): {NO_DIALECT}" in lines


def test_loads_not_asked_or_not_known_say_so_in_one_line() -> None:
    fleet = parse_fleet(FLEET, "fleet.yaml")
    offline = explain(fleet, "big", yaml.safe_load(FLEET))
    assert offline["loads"] == {"asked": False, "server": None, "error": None}
    assert "  loads     not asked (--offline); `cpctl endpoints list --model big` shows them" in lines_of(
        offline
    )
    down = LiveLoads("127.0.0.1:18001", error="no control plane answered at 127.0.0.1:18001")
    e = explain(fleet, "big", yaml.safe_load(FLEET), None, down)
    assert [v["live"] for v in e["versions"]] == [None]
    loads = [line for line in lines_of(e) if line.startswith("  loads ")]
    assert loads == [
        "  loads     unknown: no control plane answered at 127.0.0.1:18001; "
        "`cpctl endpoints list --model big` shows them"
    ]
    assert not any(line.startswith("  LIVE ") for line in lines_of(e))


def test_fetch_loads_reads_the_endpoints_as_cpctl_does(operator_api: str) -> None:
    got = fetch_loads("chat", operator_api, env={"CPCTL_TOKEN": "secret"})
    assert got.error is None and got.server == operator_api
    assert [(e["version"], e["address"], e["running"]) for e in got.endpoints] == [
        ("v1", "127.0.10.1:8000", None),
        ("v1", "127.0.10.2:8000", 4),
        ("v2", "127.0.10.4:8000", 0),
    ]
    assert fetch_loads("nope", operator_api, env={"CPCTL_TOKEN": "secret"}).error == (
        "NOT_FOUND: unknown model 'nope'"
    )
    refused = fetch_loads("chat", operator_api, env={"CPCTL_TOKEN": "wrong"}).error
    assert refused is not None and "UNAUTHENTICATED: the token is not valid" in refused
    server = closed_port()
    started = time.monotonic()
    assert (
        fetch_loads("chat", server, env={"CPCTL_TOKEN": "secret"}).error
        == f"no control plane answered at {server}"
    )
    assert time.monotonic() - started < 2 * LIVE_DEADLINE_S + 0.5


def test_explain_cli_shows_the_live_loads(
    operator_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import controlplane.cli.explain as explain_module

    monkeypatch.setattr(explain_module, "fetch_loads", fetch_loads)
    monkeypatch.setenv("CPCTL_TOKEN", "secret")
    monkeypatch.delenv("CPCTL_TOKEN_FILE", raising=False)
    path = write(tmp_path, FLEET)
    assert main(["explain", "chat", "--config", str(path), "--server", operator_api]) == 0
    text = capsys.readouterr().out
    assert f"  loads     live from {operator_api}, per version below" in text
    assert f"  - 127.0.10.1:8000: last scrape read no load (no_dialect): {NO_DIALECT}" in text
    assert main(["explain", "chat", "--config", str(path), "--server", operator_api, "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["versions"][0]["live"][0]["running"] is None and doc["versions"][1]["live"][0]["running"] == 0
    # --offline asks nothing.
    assert main(["explain", "chat", "--config", str(path), "--server", operator_api, "--offline"]) == 0
    assert "  loads     not asked (--offline)" in capsys.readouterr().out


def test_a_picked_model_shows_its_picker_budget_and_fallback() -> None:
    text = (
        "listener: {port: 10000}\n"
        "picker: {endpoints: ['127.0.0.1:18090', '127.0.0.1:18092'], timeout: 8ms}\n"
        "tiers: {small: {max_params_b: 20, balancing: picker}}\n"
        "models:\n"
        "  chat: {params_b: 8, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9001']}}}\n"
        "  hashed: {params_b: 8, affinity: {prefix: {messages: 1}}, stable: v1,\n"
        "           versions: {v1: {endpoints: ['127.0.0.1:9002']}}}\n"
    )
    e = explained(text, "chat")
    pk = e["envoy"]["picker"]
    assert pk["endpoints"] == ["127.0.0.1:18090", "127.0.0.1:18092"]
    assert pk["budget_s"] == pytest.approx(0.008)
    assert pk["fallback"] == "least_request"
    assert "envoy_http_ext_proc_picker_failure_mode_allowed" in pk["fallbacks_counted_in"]
    table = render_text(e)
    assert "asks 127.0.0.1:18090, 127.0.0.1:18092 within 8ms" in table, table
    assert "else least_request with the control plane's weights" in table
    assert explained(text, "hashed")["envoy"]["picker"]["fallback"] in ("maglev", "ring_hash")
    assert explained(FLEET, "chat")["envoy"]["picker"] is None


def test_explain_says_a_models_adapters_and_how_they_are_placed() -> None:
    from tests.unit.test_fleet_adapters import ADAPTERS
    from tests.unit.test_fleet_adapters import FLEET as ADAPTER_FLEET

    picked = explained(
        ADAPTER_FLEET % ("placement: dynamic\n    " + ADAPTERS.replace("bare:", "bare: {source: /b}")),
        "base.1",
    )
    a = picked["envoy"]["adapters"]
    assert a["names"] == ["sql-lora", "chat.lora", "bare"] and a["placement"] == "dynamic" and a["picked"]
    assert "where it is loaded" in a["text"] and "loaded onto one first" in a["text"]
    assert "without a pick, Envoy hashes each adapter's requests on its name" in a["text"]
    weighed = explained((ADAPTER_FLEET % ADAPTERS).replace(", balancing: picker", ""), "base.1")
    text = weighed["envoy"]["adapters"]["text"]
    assert "no picker: Envoy hashes each adapter's requests on its name (bounded load)" in text
    assert "; sql-lora only to its endpoints (Envoy subsets)" in text
    assert weighed["envoy"]["load_balancer"] == "maglev"  # within the subsets
    assert weighed["affinity"]["adapter"]
    off = explained(
        (ADAPTER_FLEET % ("affinity: false\n    adapters: {bare: {}}")).replace(", balancing: picker", ""),
        "base.1",
    )
    assert (
        "no picker: Envoy routes them as the base model's, wherever the adapter is"
        in (off["envoy"]["adapters"]["text"])
    )
    assert off["envoy"]["load_balancer"] == "least_request" and off["affinity"] is None
    assert explained(ADAPTER_FLEET % "", "other")["envoy"]["adapters"] is None
