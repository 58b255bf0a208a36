from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.cli.main import main
from controlplane.fleet import FleetConfigInvalid, load_fleet, parse_fleet
from controlplane.fleet.model import HealthProbe, MetricsProbe, PrometheusSpec
from controlplane.fleet.values import parse_address, parse_duration
from tests.fleets import BASIC


def errors_of(text: str) -> list[str]:
    with pytest.raises(FleetConfigInvalid) as e:
        parse_fleet(text, "fleet.yaml")
    return [str(x) for x in e.value.errors]


def test_the_documented_shape_loads() -> None:
    fleet = parse_fleet(BASIC)
    assert fleet.listener.port == 10000
    assert [t.name for t in fleet.tiers] == ["small", "medium", "large"]
    m = fleet.model("llama-3-8b")
    assert m.tier == "small"
    assert m.stable == "v1"
    assert [e.address for e in m.version("v1").endpoints] == ["127.0.0.1:8101", "127.0.0.1:8102"]
    assert m.version("v1").endpoints[0].gpu == "A100"
    assert m.version("v1").endpoints[0].gpu_memory_gb == 80
    assert fleet.tier("medium").timeout_s == 180


@pytest.mark.parametrize(
    ("params", "tier"), [(8, "small"), (15, "small"), (15.5, "medium"), (70, "medium"), (405, "large")]
)
def test_tier_is_derived_from_size(params: float, tier: str) -> None:
    fleet = parse_fleet(BASIC.replace("    params_b: 8\n", f"    params_b: {params}\n"))
    assert fleet.model("llama-3-8b").tier == tier


def test_explicit_tier_wins() -> None:
    fleet = parse_fleet(BASIC.replace("    params_b: 8\n", "    params_b: 8\n    tier: large\n"))
    assert fleet.model("llama-3-8b").tier == "large"


def test_unknown_key_names_path_and_line() -> None:
    errs = errors_of(BASIC.replace("stable: v1", "stable: v1\n    stabel: v2"))
    assert errs == [
        "fleet.yaml:10: models.llama-3-8b.stabel: unknown key (allowed: adapters, affinity, autoscaling, "
        "balancing, circuit_breakers, cluster_overrides, dtype, flow_control, health, kv_events, "
        "max_body_bytes, memory_gb, metrics, outlier_detection, params_b, placement, preferred_gpus, "
        "protocol, retries, slo, stable, "
        "stream_idle_timeout, tier, timeout, tokenizer, versions, zones)"
    ]


def test_bad_address() -> None:
    errs = errors_of(BASIC.replace("127.0.0.1:8102", "localhost:8102"))
    assert len(errs) == 1
    assert "models.llama-3-8b.versions.v1.endpoints[1].address" in errs[0]
    assert "not an IP address" in errs[0]


def test_bad_port() -> None:
    errs = errors_of(BASIC.replace("127.0.0.1:8102", "127.0.0.1:99999"))
    assert "port must be 1-65535" in errs[0]


def test_duplicate_endpoint_across_versions() -> None:
    errs = errors_of(BASIC.replace("127.0.0.1:8103", "127.0.0.1:8101"))
    assert len(errs) == 1
    assert "versions.v2.endpoints[0].address: duplicate endpoint 127.0.0.1:8101" in errs[0]
    assert "already at models.llama-3-8b.versions.v1.endpoints[0]" in errs[0]


def test_stable_naming_a_missing_version() -> None:
    errs = errors_of(BASIC.replace("stable: v1", "stable: v9"))
    assert errs == ["fleet.yaml:9: models.llama-3-8b.stable: names version 'v9', which is not under versions"]


def test_a_model_no_tier_can_hold() -> None:
    text = BASIC.replace("  large:  {timeout: 600s}\n", "").replace(
        "    params_b: 8\n", "    params_b: 405\n"
    )
    errs = errors_of(text)
    assert len(errs) == 1
    assert "models.llama-3-8b.params_b: no tier can hold a 405B model" in errs[0]


def test_explicit_tier_too_small() -> None:
    errs = errors_of(BASIC.replace("    params_b: 8\n", "    params_b: 70\n    tier: small\n"))
    assert "tier 'small' holds models up to 15B; this one has 70B" in errs[0]


def test_duplicate_yaml_key() -> None:
    errs = errors_of(BASIC.replace("stable: v1", "stable: v1\n    stable: v2"))
    assert any("models.llama-3-8b.stable: duplicate key" in e for e in errs)


def test_bad_duration_and_tier_order() -> None:
    text = BASIC.replace("timeout: 60s", "timeout: soon").replace("max_params_b: 80", "max_params_b: 10")
    errs = errors_of(text)
    assert any("tiers.small.timeout: expected a duration" in e for e in errs)
    assert any("tiers.medium.max_params_b: tiers must be listed smallest first" in e for e in errs)


def test_unbounded_tier_must_be_last() -> None:
    text = BASIC.replace("  small:  {max_params_b: 15, timeout: 60s}", "  small:  {timeout: 60s}")
    errs = errors_of(text)
    assert any("tiers.medium: tier 'small' has no max_params_b" in e for e in errs)


def test_every_error_is_reported_at_once() -> None:
    text = BASIC.replace("stable: v1", "stable: v9").replace("127.0.0.1:8102", "nope")
    assert len(errors_of(text)) == 2


def test_not_yaml() -> None:
    errs = errors_of("listener: {port: 10000\n")
    assert "not valid YAML" in errs[0]


def test_cluster_overrides_are_checked_against_the_envoy_schema() -> None:
    ok = parse_fleet(BASIC.replace("stable: v1", "stable: v1\n    cluster_overrides: {connect_timeout: 5s}"))
    assert ok.model("llama-3-8b").cluster_overrides == {"connect_timeout": "5s"}
    errs = errors_of(BASIC.replace("stable: v1", "stable: v1\n    cluster_overrides: {conect_timeout: 5s}"))
    assert "models.llama-3-8b.cluster_overrides: not a valid Envoy Cluster fragment" in errs[0]
    errs = errors_of(BASIC.replace("stable: v1", "stable: v1\n    cluster_overrides: {name: x}"))
    assert "cluster_overrides.name: is managed by the control plane" in errs[0]


@pytest.mark.parametrize(
    ("text", "seconds"), [("60s", 60), ("500ms", 0.5), ("3m", 180), ("1h", 3600), (2, 2), ("1.5s", 1.5)]
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "5", "5x", "-1s", "0s", True, None])
def test_bad_durations(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_ipv6_address() -> None:
    assert parse_address("[::1]:8000") == ("::1", 8000)


def test_check_config_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(BASIC)
    assert main(["check-config", str(good)]) == 0
    assert "ok: 3 tiers, 1 models, 3 endpoints" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASIC.replace("stable: v1", "stable: v9"))
    assert main(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:9: models.llama-3-8b.stable: names version 'v9'" in err
    assert main(["check-config", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read file" in capsys.readouterr().err


def test_load_fleet_reads_a_file(tmp_path: Path) -> None:
    p = tmp_path / "f.yaml"
    p.write_text(BASIC)
    assert load_fleet(p).model("llama-3-8b").stable == "v1"


def test_balancing_gpu_classes_and_signals() -> None:
    text = (
        BASIC.replace(
            "small:  {max_params_b: 15, timeout: 60s}", "small:  {max_params_b: 15, balancing: round_robin}"
        ).replace("{address: 127.0.0.1:8102}", "{address: 127.0.0.1:8102, capacity: 0.5}")
        + "gpu_classes: {A100: {capacity: 2.5}}\nsignals: {interval: 2s, timeout: 300ms, slow_start: 10s}\n"
    )
    fleet = parse_fleet(text)
    m = fleet.model("llama-3-8b")
    assert fleet.policy_of(m) == "round_robin"
    assert [fleet.capacity_of(e) for e in m.version("v1").endpoints] == [2.5, 0.5]
    assert fleet.capacity_of(m.version("v2").endpoints[0]) == 1.0  # no GPU class: the reference
    assert (fleet.signals.interval_s, fleet.signals.timeout_s, fleet.signals.slow_start_s) == (2.0, 0.3, 10.0)
    # A model's own policy wins over its tier's; the default is adaptive.
    own = parse_fleet(
        BASIC.replace("    stable: v1\n", "    stable: v1\n    balancing: least_connections\n", 1)
    )
    assert own.policy_of(own.model("llama-3-8b")) == "least_connections"
    assert parse_fleet(BASIC).policy_of(parse_fleet(BASIC).model("llama-3-8b")) == "adaptive"


def test_balancing_and_signals_errors_name_the_field() -> None:
    errs = errors_of(
        BASIC.replace("stable: v1", "stable: v1\n    balancing: fastest", 1)
        + "gpu_classes: {L4: {capacity: 0}}\nsignals: {interval: 1s, timeout: 2s, metrics_path: metrics}\n"
    )
    assert any(
        "models.llama-3-8b.balancing: unknown balancing policy 'fastest' (policies: " in e for e in errs
    )
    assert any("gpu_classes.L4.capacity: must be greater than 0, got 0" in e for e in errs)
    assert any("signals.metrics_path: expected a path starting with '/', got 'metrics'" in e for e in errs)
    errs = errors_of(BASIC + "signals: {interval: 1s, timeout: 2s}\n")
    assert errs == ["fleet.yaml:17: signals.timeout: must not exceed signals.interval (1s)"]


def test_memory_fit_is_declared_or_derived_from_size_and_dtype() -> None:
    fleet = parse_fleet(
        BASIC.replace("    params_b: 8\n", "    params_b: 8\n    dtype: fp8\n    preferred_gpus: [A100]\n")
        + "gpu_classes: {A100: {memory_gb: 80}, L4: {memory_gb: 24}}\n"
    )
    m = fleet.model("llama-3-8b")
    assert m.preferred_gpus == ("A100",)
    assert fleet.memory_need_of(m) == pytest.approx(8 * 1.0 * 1.2)
    ep = m.version("v1").endpoints[0]
    assert fleet.gpu_memory_of(ep) == 80 and fleet.fits(m, ep)
    big = parse_fleet(BASIC.replace("    params_b: 8\n", "    params_b: 8\n    memory_gb: 90\n"))
    assert not big.fits(big.model("llama-3-8b"), ep)  # 90 GB needed, the endpoint has 80
    assert big.fits(big.model("llama-3-8b"), m.version("v2").endpoints[0])  # unknown memory: assume so


def test_memory_fields_are_checked() -> None:
    errs = errors_of(
        BASIC.replace("    params_b: 8\n", "    params_b: 8\n    dtype: fp12\n    preferred_gpus: A100\n")
        + "gpu_classes: {L4: {memory_gb: -1}}\n"
    )
    assert any(
        "models.llama-3-8b.dtype: expected one of fp32, fp16, bf16, fp8, int8, int4, got 'fp12'" in e
        for e in errs
    )
    assert any(
        "models.llama-3-8b.preferred_gpus: expected a list of GPU class names, got 'A100'" in e for e in errs
    )
    assert any("gpu_classes.L4.memory_gb: must be greater than 0, got -1" in e for e in errs)


def test_traffic_policy_errors_name_the_field() -> None:
    errs = errors_of(
        BASIC.replace(
            "small:  {max_params_b: 15, timeout: 60s}",
            "small:  {max_params_b: 15, retries: 11, circuit_breakers: {low: {}},"
            " outlier_detection: {interval: x}}",
        )
    )
    assert any("tiers.small.retries: expected a whole number 0-10, got 11" in e for e in errs)
    assert any("tiers.small.circuit_breakers.low: unknown key (allowed: default, high)" in e for e in errs)
    assert any("tiers.small.outlier_detection.interval: expected a duration" in e for e in errs)


PLACED = """\
listener: {port: 10000}
tiers: {all: {}}
gpu_classes: {H100: {memory_gb: 80}, L4: {memory_gb: 24}}
models:
  big:
    params_b: 70
    stable: v1
    versions: {v1: {endpoints: [{address: 10.0.0.1:80, gpu: L4}, {address: 10.0.0.2:80, gpu: L4}]}}
"""


def test_a_model_that_fits_no_endpoint_is_an_error_naming_the_shortfall() -> None:
    errs = errors_of(PLACED)
    assert errs == [
        "fleet.yaml:5: models.big: needs 168 GB of GPU memory (70B parameters x 2 bytes (fp16) x 1.2) "
        "but its largest endpoint has 24 GB: 144 GB short; add endpoints with more memory, "
        "a smaller dtype, or set memory_gb"
    ]
    # One endpoint of unknown memory gets the benefit of the doubt; int4 fits the L4s.
    parse_fleet(PLACED.replace("{address: 10.0.0.2:80, gpu: L4}", "{address: 10.0.0.2:80}"))
    parse_fleet(
        PLACED.replace("params_b: 70", "params_b: 70\n    dtype: int4").replace(
            "memory_gb: 24", "memory_gb: 48"
        )
    )


def test_max_pending_zero_is_refused() -> None:
    errs = errors_of(
        BASIC.replace(
            "small:  {max_params_b: 15, timeout: 60s}",
            "small:  {max_params_b: 15, circuit_breakers: {default: {max_pending: 0}}}",
        )
    )
    assert any(
        "tiers.small.circuit_breakers.default.max_pending: expected a whole number 1-" in e for e in errs
    )


def test_priority_classes_load_highest_first() -> None:
    fleet = parse_fleet(
        BASIC + "priority_classes:\n  premium: {routing_priority: high}\n  standard: {shed_at: 1.0}\n"
        "  batch: {shed_at: 0.5}\ndefault_priority_class: standard\n"
    )
    assert [(c.name, c.high, c.shed_at) for c in fleet.priority_classes] == [
        ("premium", True, None),
        ("standard", False, 1.0),
        ("batch", False, 0.5),
    ]
    assert fleet.default_priority_class == "standard"


def test_priority_classes_errors() -> None:
    errs = errors_of(
        BASIC
        + "priority_classes:\n  premium: {shed_at: 0.2}\n  standard: {shed_at: 1.0, routing_priority: top}\n"
        "default_priority_class: gold\n"
    )
    assert any(
        "priority_classes.standard.routing_priority: expected default or high, got 'top'" in e for e in errs
    )
    assert any("default_priority_class: unknown class 'gold'" in e for e in errs)
    errs = errors_of(BASIC + "priority_classes:\n  premium: {shed_at: 0.2}\n  standard: {shed_at: 1.0}\n")
    assert any(
        "priority_classes.standard.shed_at: 1.0 is above priority_classes.premium's 0.2" in e for e in errs
    )
    assert any("default_priority_class: missing" in e for e in errs)


def test_affinity_errors() -> None:
    errs = errors_of(
        BASIC.replace("    stable: v1\n", "    stable: v1\n    affinity: {header: X-S, body: cookie}\n", 1)
    )
    assert any("models.llama-3-8b.affinity: give exactly one of header" in e for e in errs)
    assert any("models.llama-3-8b.affinity.header: expected a lower-case header name" in e for e in errs)
    assert any(
        "models.llama-3-8b.affinity.body: expected one of prompt_cache_key, user, got 'cookie'" in e
        for e in errs
    )
    errs = errors_of(
        BASIC.replace(
            "    stable: v1\n", "    stable: v1\n    affinity: {header: x-s, hash_balance_factor: 90}\n", 1
        )
    )
    assert any("affinity.hash_balance_factor: expected a whole number 100-100000, got 90" in e for e in errs)
    errs = errors_of(
        BASIC.replace(
            "    stable: v1\n", "    stable: v1\n    affinity: {prefix: {messages: 0, max_bytes: 10**9}}\n", 1
        )
    )
    assert any("affinity.prefix.messages: expected a whole number 1-64, got 0" in e for e in errs)
    assert any("affinity.prefix.max_bytes" in e for e in errs)
    errs = errors_of(
        BASIC.replace("    stable: v1\n", "    stable: v1\n    affinity: {prefix: true, header: x-s}\n", 1)
    )
    assert any("give exactly one of header (e.g. x-session-id), body" in e for e in errs)


def test_the_example_fleet_in_deploy_loads() -> None:
    fleet = load_fleet(Path(__file__).resolve().parents[2] / "deploy" / "fleet.yaml")
    assert {m.name for m in fleet.models} == {"llama-3-8b", "qwen-2.5-72b"}


def test_a_stable_version_that_fits_nowhere_and_unknown_preferred_classes_are_errors() -> None:
    text = PLACED.replace(
        "    versions: {v1: {endpoints: [{address: 10.0.0.1:80, gpu: L4}, {address: 10.0.0.2:80, gpu: L4}]}}",
        "    preferred_gpus: [B200]\n"
        "    versions:\n      v1: {endpoints: [{address: 10.0.0.1:80, gpu: L4}]}\n"
        "      v2: {endpoints: [{address: 10.0.0.2:80, gpu: H100}]}",
    ).replace("params_b: 70", "params_b: 30")
    errs = errors_of(text)
    assert any(
        "models.big.versions.v1: the stable version's endpoints all have less than the 72 GB" in e
        for e in errs
    )
    assert any("models.big.preferred_gpus: 'B200' is neither a gpu_classes entry" in e for e in errs)


# ---- signals.source: prometheus ----------------------------------------------------------


def test_the_signal_source_defaults_to_scrape() -> None:
    fleet = parse_fleet(BASIC)
    assert (fleet.signals.source, fleet.signals.prometheus) == ("scrape", None)


def test_the_prometheus_source_loads_with_its_settings() -> None:
    fleet = parse_fleet(
        BASIC + "signals:\n  source: prometheus\n  prometheus: {url: 'http://127.0.0.9:9090/', interval: 3s, "
        "timeout: 800ms, address_label: pod_address}\n"
    )
    assert fleet.signals.source == "prometheus"
    assert fleet.signals.prometheus == PrometheusSpec(
        url="http://127.0.0.9:9090", interval_s=3.0, timeout_s=0.8, address_label="pod_address"
    )


def test_the_prometheus_source_defaults_everything_but_the_url() -> None:
    fleet = parse_fleet(
        BASIC + "signals: {source: prometheus, prometheus: {url: 'https://prom.example/x'}}\n"
    )
    assert fleet.signals.prometheus == PrometheusSpec(url="https://prom.example/x")
    assert (fleet.signals.prometheus.interval_s, fleet.signals.prometheus.timeout_s) == (2.0, 1.0)
    assert fleet.signals.prometheus.address_label == "instance"


def test_a_prometheus_section_is_kept_while_the_source_is_scrape() -> None:
    fleet = parse_fleet(BASIC + "signals: {prometheus: {url: 'http://127.0.0.1:9090'}}\n")
    assert fleet.signals.source == "scrape"
    assert fleet.signals.prometheus is not None


def test_an_unknown_signal_source_is_refused() -> None:
    assert errors_of(BASIC + "signals: {source: promql}\n") == [
        "fleet.yaml:17: signals.source: unknown source 'promql' (known: prometheus, scrape)"
    ]


def test_the_prometheus_source_needs_its_section_and_url() -> None:
    assert errors_of(BASIC + "signals: {source: prometheus}\n") == [
        "fleet.yaml:17: signals.prometheus: required when signals.source is prometheus (at least its url)"
    ]
    assert errors_of(BASIC + "signals: {source: prometheus, prometheus: {interval: 2s}}\n") == [
        "fleet.yaml:17: signals.prometheus.url: required: the Prometheus server, e.g. http://prometheus:9090"
    ]


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (
            "ftp://127.0.0.9:9090",
            "expected http://HOST:PORT or https://HOST:PORT, got 'ftp://127.0.0.9:9090'",
        ),
        ("127.0.0.9:9090", "expected http://HOST:PORT or https://HOST:PORT, got '127.0.0.9:9090'"),
        ("http://", "expected http://HOST:PORT or https://HOST:PORT, got 'http://'"),
        ("9090", "expected http://HOST:PORT or https://HOST:PORT, got 9090"),
        ("http://127.0.0.9:9090/?x=1", "expected no query or fragment, got 'http://127.0.0.9:9090/?x=1'"),
        ("http://127.0.0.9:99999", "bad port in 'http://127.0.0.9:99999'"),
    ],
)
def test_a_prometheus_url_that_is_not_http_is_refused(url: str, reason: str) -> None:
    value = url if url == "9090" else f"'{url}'"
    errs = errors_of(BASIC + f"signals: {{source: prometheus, prometheus: {{url: {value}}}}}\n")
    assert len(errs) == 1, errs
    assert errs[0].startswith("fleet.yaml:17: signals.prometheus.url: " + reason), errs


def test_prometheus_settings_errors_name_the_field() -> None:
    errs = errors_of(
        BASIC + "signals:\n  source: prometheus\n  prometheus:\n    url: 'http://127.0.0.1:9090'\n"
        "    interval: soon\n    timeout: -1s\n    address_label: 'host:port'\n    job: vllm\n"
    )
    assert errs == [
        "fleet.yaml:24: signals.prometheus.job: unknown key (allowed: address_label, interval, timeout, url)",
        "fleet.yaml:21: signals.prometheus.interval: expected a duration such as 60s, 500ms, 3m; got 'soon'",
        "fleet.yaml:22: signals.prometheus.timeout: expected a duration such as 60s, 500ms, 3m; got '-1s'",
        "fleet.yaml:23: signals.prometheus.address_label: expected a Prometheus label name, got 'host:port'",
    ]
    errs = errors_of(BASIC + "signals: {source: prometheus, prometheus: [http://127.0.0.1:9090]}\n")
    assert errs == ["fleet.yaml:17: signals.prometheus: expected a mapping, got a list"]


def test_the_prometheus_timeout_is_within_its_interval() -> None:
    errs = errors_of(
        BASIC + "signals: {source: prometheus, prometheus: {url: 'http://127.0.0.1:9090', interval: 1s, "
        "timeout: 2s}}\n"
    )
    assert errs == [
        "fleet.yaml:17: signals.prometheus.timeout: must not exceed signals.prometheus.interval (1s)"
    ]


def test_signals_go_stale_no_sooner_than_one_prometheus_interval() -> None:
    text = (
        "signals: {source: prometheus, stale_after: 3s, "
        "prometheus: {url: 'http://127.0.0.1:9090', interval: 5s}}\n"
    )
    errs = errors_of(BASIC + text)
    assert errs == [
        "fleet.yaml:17: signals.stale_after: must be at least signals.prometheus.interval (5s) with the "
        "prometheus source"
    ]
    # The same section with the scrape source is not checked: its interval is not used.
    assert (
        parse_fleet(BASIC + text.replace("source: prometheus", "source: scrape")).signals.source == "scrape"
    )


def test_probes_per_model_and_version() -> None:
    fleet = parse_fleet(
        "listener: {port: 10000}\ntiers: {small: {}}\nmodels:\n"
        "  t: {params_b: 1, stable: v1, health: {http: {path: /v2/health/ready}}, metrics: {port: 8002},\n"
        "      versions: {v1: {endpoints: ['127.0.0.1:8000']},\n"
        "                 v2: {health: none, metrics: none, endpoints: ['127.0.0.1:9000']}}}\n"
        "  g: {params_b: 1, stable: v1, protocol: http2, versions: {v1: {endpoints: ['127.0.0.1:7000']}}}\n"
        "  h: {params_b: 1, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:7001']}}}\n"
    )
    t, g, h = (fleet.model(n) for n in ("t", "g", "h"))
    assert fleet.health_of(t, t.version("v1")) == HealthProbe("http", path="/v2/health/ready")
    assert fleet.metrics_of(t, t.version("v1")) == MetricsProbe(path="/metrics", port=8002)
    assert fleet.health_of(t, t.version("v2")).kind == "none"
    assert not fleet.metrics_of(t, t.version("v2")).enabled
    assert fleet.health_of(g, g.version("v1")) == HealthProbe("grpc")  # gRPC servers: gRPC health
    assert fleet.health_of(h, h.version("v1")) == HealthProbe("http", path="/health")


def test_probe_errors_name_the_field() -> None:
    errs = errors_of(
        BASIC.replace(
            "stable: v1",
            "stable: v1\n    health: {grpc: {service: 3, path: /x}}\n"
            "    metrics: {port: 0, scheme: ftp, path: metrics}",
        )
    )
    joined = "\n".join(errs)
    assert "models.llama-3-8b.health.grpc.path: unknown key (allowed: port, service)" in joined
    assert "models.llama-3-8b.health.grpc.service: expected a gRPC service name" in joined
    assert "models.llama-3-8b.metrics.port: expected a port number 1-65535, got 0" in joined
    assert "models.llama-3-8b.metrics.scheme: expected one of http, https, got 'ftp'" in joined
    assert "models.llama-3-8b.metrics.path: expected a path starting with '/'" in joined
    bad_kind = errors_of(BASIC.replace("stable: v1", "stable: v1\n    health: {tcp: {port: 1}}"))
    assert any("models.llama-3-8b.health: expected none, {http:" in e for e in bad_kind)


# ---- GPU class names: case-insensitive, a near miss is an error --------------------------

GPU_FLEET = """\
listener: {port: 10000}
tiers: {all: {}}
gpu_classes: {A100: {capacity: 1.0, memory_gb: 80}, L4: {capacity: 0.35, memory_gb: 24}}
models:
  m:
    params_b: 8
    stable: v1
    versions:
      v1:
        endpoints:
          - {address: 127.0.0.1:8001, gpu: GPU}
"""


def _gpu_fleet(gpu: str, extra: str = "") -> str:
    return GPU_FLEET.replace("gpu: GPU", f"gpu: {gpu!r}").replace(
        "    stable: v1\n", f"    stable: v1\n{extra}"
    )


@pytest.mark.parametrize(
    ("written", "cls"),
    [("A100", "A100"), ("a100", "A100"), ("A100", "A100"), ("l4", "L4"), ("L4", "L4")],
)
def test_a_gpu_names_its_class_whatever_the_case(written: str, cls: str) -> None:
    from controlplane.fleet.schema_gpus import match_gpu_class

    assert match_gpu_class(written, ["A100", "L4"]) == cls
    fleet = parse_fleet(_gpu_fleet(written))
    ep = fleet.model("m").version("v1").endpoints[0]
    assert ep.gpu == cls  # spelled as the class, so every lookup finds it
    assert fleet.declared_capacity(ep) == {"A100": 1.0, "L4": 0.35}[cls]
    assert fleet.gpu_memory_of(ep) == {"A100": 80, "L4": 24}[cls]


@pytest.mark.parametrize(
    ("written", "suggested"),
    [
        ("a10O", "A100"),
        ("A1000", "A100"),
        ("A-100", "A100"),
        ("A 100", "A100"),
        ("a100 ", "A100"),
        ("AI00", "A100"),
        ("L4.", "L4"),
    ],
)
def test_a_near_miss_of_a_class_is_an_error_naming_the_path_and_the_classes(
    written: str, suggested: str
) -> None:
    from controlplane.fleet.schema_gpus import match_gpu_class

    with pytest.raises(ValueError, match=f"did you mean '{suggested}'"):
        match_gpu_class(written, ["A100", "L4"])
    errs = errors_of(_gpu_fleet(written))
    assert errs == [
        f"fleet.yaml:11: models.m.versions.v1.endpoints[0].gpu: {written!r} is not a GPU class; did "
        f"you mean '{suggested}'? (gpu_classes: A100, L4; if it is another class, declare it there)"
    ]


@pytest.mark.parametrize(
    "written",
    # Real GPUs next to a declared class, and names that resemble no class: no class, no error.
    ["A10", "a10g", "L40", "L40S", "H100", "h200", "T4", "MI300X", "nvidia-a100", "A100-40GB", "X"],
)
def test_a_gpu_that_is_no_near_miss_keeps_its_name_and_gets_no_class(written: str) -> None:
    from controlplane.fleet.schema_gpus import match_gpu_class

    assert match_gpu_class(written, ["A100", "L4"]) is None
    fleet = parse_fleet(_gpu_fleet(written))
    ep = fleet.model("m").version("v1").endpoints[0]
    assert ep.gpu == written
    assert fleet.declared_capacity(ep) is None  # learnt at run time, as documented


def test_without_gpu_classes_nothing_is_a_near_miss() -> None:
    from controlplane.fleet.schema_gpus import match_gpu_class

    assert match_gpu_class("a10O", []) is None
    text = _gpu_fleet("a10O").replace(
        "gpu_classes: {A100: {capacity: 1.0, memory_gb: 80}, L4: {capacity: 0.35, memory_gb: 24}}\n", ""
    )
    assert parse_fleet(text).model("m").version("v1").endpoints[0].gpu == "a10O"


def test_preferred_gpus_match_classes_and_endpoints_case_insensitively() -> None:
    fleet = parse_fleet(_gpu_fleet("a100", "    preferred_gpus: [a100, l4]\n"))
    m = fleet.model("m")
    assert m.preferred_gpus == ("A100", "L4")
    assert fleet.endpoint_priority(m, m.version("v1").endpoints[0]) == 0
    # A GPU no class declares: one spelling for all, the first an endpoint uses.
    text = (
        _gpu_fleet("h200", "    preferred_gpus: [H200]\n")
        .replace(
            "gpu_classes: {A100: {capacity: 1.0, memory_gb: 80}, L4: {capacity: 0.35, memory_gb: 24}}\n", ""
        )
        .replace(
            "          - {address: 127.0.0.1:8001, gpu: 'h200'}\n",
            "          - {address: 127.0.0.1:8001, gpu: 'h200'}\n"
            "          - {address: 127.0.0.1:8002, gpu: H200}\n",
        )
    )
    fleet = parse_fleet(text)
    m = fleet.model("m")
    assert [ep.gpu for ep in m.version("v1").endpoints] == ["h200", "h200"]
    assert m.preferred_gpus == ("h200",)
    assert {fleet.endpoint_priority(m, ep) for ep in m.version("v1").endpoints} == {0}


def test_a_preferred_gpu_that_matches_nothing_suggests_the_nearest() -> None:
    errs = errors_of(_gpu_fleet("A100", "    preferred_gpus: [a10O]\n"))
    assert errs == [
        "fleet.yaml:8: models.m.preferred_gpus: 'a10O' is neither a gpu_classes entry nor the gpu of "
        "any of its endpoints; did you mean 'A100'?"
    ]


def test_discover_defaults_are_matched_too() -> None:
    text = GPU_FLEET.replace(
        "        endpoints:\n          - {address: 127.0.0.1:8001, gpu: GPU}\n",
        "        discover: {srv: _http._tcp.m.test, gpu: GPU}\n",
    )
    fleet = parse_fleet(text.replace("gpu: GPU", "gpu: l4"))
    template = fleet.model("m").version("v1").discover.template  # type: ignore[union-attr]
    assert template is not None and template.gpu == "L4"
    errs = errors_of(text.replace("gpu: GPU", "gpu: L44"))
    assert (
        len(errs) == 1
        and "models.m.versions.v1.discover.gpu: 'L44' is not a GPU class; did you mean 'L4'?" in errs[0]
    )


def test_two_classes_differing_only_in_case_are_an_error() -> None:
    errs = errors_of(
        _gpu_fleet("A100").replace("L4: {capacity: 0.35, memory_gb: 24}", "a100: {capacity: 0.5}")
    )
    assert any(
        "gpu_classes.a100: the same class as 'A100': GPU class names match case-insensitively" in e
        for e in errs
    )


def test_every_near_miss_is_reported_at_once() -> None:
    text = _gpu_fleet("a10O").replace(
        "          - {address: 127.0.0.1:8001, gpu: 'a10O'}\n",
        "          - {address: 127.0.0.1:8001, gpu: 'a10O'}\n"
        "          - {address: 127.0.0.1:8002, gpu: 'a100'}\n"
        "          - {address: 127.0.0.1:8003, gpu: 'A1000'}\n",
    )
    errs = errors_of(text)
    assert [e.split(": ", 2)[1] for e in errs] == [
        "models.m.versions.v1.endpoints[0].gpu",
        "models.m.versions.v1.endpoints[2].gpu",
    ]


def test_slos_default_then_tier_then_model_key_by_key() -> None:
    text = BASIC.replace(
        "  small:  {max_params_b: 15, timeout: 60s}",
        "  small:  {max_params_b: 15, timeout: 60s, slo: {availability: 0.99, ttft: 1s}}",
    ).replace("    params_b: 8\n", "    params_b: 8\n    slo: {ttft_objective: 0.95}\n")
    fleet = parse_fleet(text)
    slo = fleet.slo_of(fleet.model("llama-3-8b"))
    # The model's key over the tier's keys over the defaults.
    assert (slo.availability, slo.ttft_s, slo.ttft_objective, slo.tpot_s) == (0.99, 1.0, 0.95, 0.1)
    plain = parse_fleet(BASIC)
    assert plain.slo_of(plain.model("llama-3-8b")).availability == 0.999


@pytest.mark.parametrize(
    ("slo", "error"),
    [
        ("{availability: 99.9}", "models.llama-3-8b.slo.availability: must be a share of requests"),
        ("{availability: 1}", "models.llama-3-8b.slo.availability: must be a share of requests"),
        ("{ttft_objective: 0.2}", "models.llama-3-8b.slo.ttft_objective: must be a share of requests"),
        ("{ttft: fast}", "models.llama-3-8b.slo.ttft: expected a duration"),
        ("{tpot: 2h}", "models.llama-3-8b.slo.tpot: must be between 1ms and 1h"),
        ("{latency: 1s}", "models.llama-3-8b.slo.latency: unknown key"),
        ("0.999", "models.llama-3-8b.slo: expected a mapping"),
    ],
)
def test_a_bad_slo_is_refused_naming_the_key(slo: str, error: str) -> None:
    errs = errors_of(BASIC.replace("    params_b: 8\n", f"    params_b: 8\n    slo: {slo}\n"))
    assert any(error in e for e in errs), errs


def test_cluster_overrides_may_not_name_another_lrs_server() -> None:
    # Proxyless gRPC clients NACK a cluster whose LRS server is not the xDS server itself.
    for key in ("lrs_server", "lrsServer"):
        errs = errors_of(
            BASIC.replace("stable: v1", f"stable: v1\n    cluster_overrides: {{{key}: {{ads: {{}}}}}}")
        )
        assert f"models.llama-3-8b.cluster_overrides.{key}: is managed by the control plane" in errs[0]
        assert "proxyless gRPC" in errs[0]
