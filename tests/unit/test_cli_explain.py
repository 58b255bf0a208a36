"""`controlplane explain`: sources of each setting, memory and EDS placement, the Envoy side,
exit codes and the JSON shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.cli.explain import UnknownModel, explain, render_text
from controlplane.cli.main import main
from controlplane.fleet import FleetConfigInvalid, load_fleet, parse_fleet

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
          - {address: 10.0.0.1:8000, gpu: H100}
          - {address: 10.0.0.2:8000, gpu: A100, capacity: 0.5}
          - {address: 10.0.0.3:8000}
      v2:
        endpoints: [{address: 10.0.0.4:8000, gpu: H100}]
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
    h100, a100, unknown = v1["10.0.0.1:8000"], v1["10.0.0.2:8000"], v1["10.0.0.3:8000"]
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
    assert retry["retry_on"] == ["connect-failure", "refused-stream", "reset-before-request"]
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
    assert e["proxyless_grpc"] == {"timeout_s": 10.0, "idle_timeout_s": None, "retries": 0}

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
    assert main(["explain", "chat", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"model chat  ({path})\n")
    assert "cluster chat@v1 takes all traffic" in out
    assert "version v2  cluster chat@v2  (not stable: no route sends it traffic)" in out


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
        "versions",
        "warnings",
    ]
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
