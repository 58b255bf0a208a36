"""Flow control's configuration: the fleet file's `flow_control` (fleet/), what Envoy and the
pickers get for it (routing/), and the picker reading it (picker/flow.py)."""

from __future__ import annotations

import json

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2

from controlplane.fleet import FleetConfigInvalid, parse_fleet
from controlplane.picker.flow import FlowConfigError, read_config, tenant_key
from controlplane.resources import names
from controlplane.routing.incremental import IncrementalTranslator
from controlplane.routing.translate import CLUSTER, EXT_PROC_FILTER, LISTENER, ROUTE, translate
from tests.unit.test_translate_picker import _hcm

FLEET = """
listener: {port: 10000}
picker: {endpoints: ['127.0.0.1:18090']}
priority_classes: {premium: {routing_priority: high}, standard: {}, batch: {}}
default_priority_class: standard
quotas: {key: {header: x-tenant}, service: {endpoints: ['127.0.0.1:18081']}, tenants: {acme: {}, globex: {}}}
tiers:
  small: {max_params_b: 20, balancing: picker, flow_control: %s}
  large: {}
models:
  picked: {params_b: 1, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9001']}}}
  weighed: {params_b: 70, tier: large, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9002']}}}
"""


def _ext_proc(d: object) -> ext_proc_pb2.ExternalProcessor:
    hcm = _hcm(d.by_type[LISTENER][names.GATEWAY_LISTENER])  # type: ignore[attr-defined]
    cfg = ext_proc_pb2.ExternalProcessor()
    next(f for f in hcm.http_filters if f.name == EXT_PROC_FILTER).typed_config.Unpack(cfg)
    return cfg


def test_defaults_and_what_envoy_and_the_picker_get() -> None:
    d = translate(parse_fleet(FLEET % "{}"))
    cfg = _ext_proc(d)
    # A picker may hold a request up to the longest wait (10 s by default) and the margin, and
    # answer 429 in Envoy's place; its budget for everything else stays the picker timeout.
    assert cfg.max_message_timeout.ToNanoseconds() == 11_000_000_000
    assert not cfg.disable_immediate_response
    assert cfg.failure_mode_allow and cfg.message_timeout.ToNanoseconds() == 5_000_000
    cluster = d.by_type[CLUSTER]["picked@v1"]
    assert isinstance(cluster, cluster_pb2.Cluster)
    text = cluster.metadata.filter_metadata[names.FLOW_METADATA_NS].fields["config"].string_value
    got = read_config(text)
    assert got.classes == ("premium", "standard", "batch") and got.default_rank == 1
    assert got.max_wait_s == (10.0, 10.0, 10.0) and got.max_requests == 1000 and got.max_bytes == 64 << 20
    assert got.tenant_header == "x-tenant"  # the quotas' key
    assert got.tenants == frozenset({"acme", "globex"})
    assert names.FLOW_METADATA_NS not in d.by_type[CLUSTER]["weighed@v1"].metadata.filter_metadata


def test_every_setting_and_the_incremental_translator_agree() -> None:
    fleet = parse_fleet(
        FLEET
        % "{max_wait: {premium: 2s, batch: 90s}, max_requests: 50, max_bytes: 1000, tenant: {header: x-org}}"
    )
    full, inc = translate(fleet), IncrementalTranslator().translate(fleet)
    for t in (CLUSTER, LISTENER, ROUTE):
        assert {n: m.SerializeToString(deterministic=True) for n, m in full.by_type[t].items()} == {
            n: m.SerializeToString(deterministic=True) for n, m in inc.by_type[t].items()
        }
    assert _ext_proc(full).max_message_timeout.ToNanoseconds() == 91_000_000_000
    cluster = full.by_type[CLUSTER]["picked@v1"]
    got = read_config(cluster.metadata.filter_metadata[names.FLOW_METADATA_NS].fields["config"].string_value)  # type: ignore[attr-defined]
    assert got.max_wait_s == (2.0, 10.0, 90.0) and got.max_requests == 50 and got.max_bytes == 1000
    assert got.tenant_header == "x-org"
    assert got.rank("premium") == 0 and got.rank("nonsense") == 1 and got.rank("") == 1


def test_without_flow_control_the_picker_never_answers_for_envoy() -> None:
    d = translate(parse_fleet((FLEET % "{}").replace(", flow_control: {}", "")))
    cfg = _ext_proc(d)
    assert cfg.disable_immediate_response and not cfg.HasField("max_message_timeout")


@pytest.mark.parametrize(
    ("flow", "field", "words"),
    [
        ("{max_wait: {gold: 1s}}", "tiers.small.flow_control.max_wait.gold", "unknown priority class"),
        ("{max_wait: 0s}", "tiers.small.flow_control.max_wait", "greater than 0"),
        ("{max_wait: {premium: 11m}}", "tiers.small.flow_control.max_wait.premium", "at most 600s"),
        ("{max_requests: 0}", "tiers.small.flow_control.max_requests", "whole number"),
        ("{max_bytes: -1}", "tiers.small.flow_control.max_bytes", "whole number"),
        ("{tenant: {header: 'X Org'}}", "tiers.small.flow_control.tenant.header", "header name"),
        ("{queue: 5}", "tiers.small.flow_control.queue", "unknown key"),
        ("[]", "tiers.small.flow_control", "expected a mapping"),
    ],
)
def test_bad_flow_control_names_the_field(flow: str, field: str, words: str) -> None:
    with pytest.raises(FleetConfigInvalid) as e:
        parse_fleet(FLEET % flow)
    errors = [(x.path, x.reason) for x in e.value.errors]
    assert any(f == field and words in m for f, m in errors), errors


def test_flow_control_needs_the_picker() -> None:
    text = (FLEET % "{}").replace("large: {}", "large: {flow_control: {}}")
    with pytest.raises(FleetConfigInvalid) as e:
        parse_fleet(text)
    assert [(x.path, x.reason) for x in e.value.errors] == [
        (
            "tiers.large.flow_control",
            "flow_control needs balancing: picker (the queue is kept by the pickers), got adaptive",
        )
    ]
    text = (FLEET % "{}").replace("picked: {params_b: 1,", "picked: {params_b: 1, balancing: adaptive,")
    with pytest.raises(FleetConfigInvalid) as e:
        parse_fleet(text)
    (err,) = e.value.errors
    assert err.path == "models.picked.balancing" and "flow_control: false" in err.reason
    # ...which a model may set to go without its tier's queue
    fleet = parse_fleet(text.replace("balancing: adaptive,", "balancing: adaptive, flow_control: false,"))
    assert fleet.flow_control_of(fleet.model("picked")) is None


GOOD = {
    "classes": ["a", "b"],
    "default_class": "b",
    "max_wait_s": [1, 2.5],
    "max_requests": 3,
    "max_bytes": 4,
    "tenant_header": "x-api-key",
}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"classes": []}, "classes and max_wait_s"),
        ({"max_wait_s": [1]}, "classes and max_wait_s"),
        ({"max_wait_s": [1, float("inf")]}, "classes and max_wait_s"),
        ({"max_wait_s": [1, True]}, "classes and max_wait_s"),
        ({"default_class": "c"}, "default_class"),
        ({"max_requests": 0}, "whole numbers"),
        ({"max_bytes": "4"}, "whole numbers"),
        ({"tenant_header": ""}, "tenant_header"),
        ({"tenants": "acme"}, "tenants"),
    ],
)
def test_the_picker_refuses_a_config_that_is_not_one(change: dict[str, object], words: str) -> None:
    assert read_config(json.dumps(GOOD)).max_wait_s == (1.0, 2.5)
    with pytest.raises(FlowConfigError, match=words):
        read_config(json.dumps({**GOOD, **change}))
    with pytest.raises(FlowConfigError, match="not JSON"):
        read_config("{")
    with pytest.raises(FlowConfigError, match="bytes"):
        read_config(" " * (1 << 20))


def test_a_tenant_key_is_kept_whole_only_while_short() -> None:
    assert tenant_key(b"acme") == "acme"
    big = tenant_key(b"k" * (10 << 20))
    assert big.startswith("sha256:") and len(big) == 71
    assert tenant_key(b"k" * (10 << 20)) == big and tenant_key(b"j" * (10 << 20)) != big
