"""The operator API's endpoint listing (admin/service.py EndpointService) over a signal store:
a figure never read is unset in the message, not 0, and the last scrape's error is given for
an endpoint in sight."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from controlplane.admin.service import EndpointService
from controlplane.fleet.loader import parse_fleet
from controlplane.obs.metrics import Metrics
from controlplane.signals.parse import ServerSample
from controlplane.signals.store import ScrapeResult, SignalStore
from controlplane.v1 import endpoint_pb2

FLEET = """
listener: {port: 10000}
tiers: {small: {max_params_b: 15}}
models:
  m:
    params_b: 8
    stable: v1
    versions:
      v1: {endpoints: ["127.0.0.1:8000", "127.0.0.2:8000", "127.0.0.3:8000"]}
"""
READ, NEVER, NO_DIALECT = "127.0.0.1:8000", "127.0.0.2:8000", "127.0.0.3:8000"


def listed(store: SignalStore) -> dict[str, endpoint_pb2.Endpoint]:
    fleet = parse_fleet(FLEET)
    controller = SimpleNamespace(
        file_fleet=fleet,
        reconciler=SimpleNamespace(fleet=fleet, weights={}),
        layers={},
        signals=store,
        drains={},
    )
    service = EndpointService(controller, tokens=None, metrics=Metrics())  # type: ignore[arg-type]
    return {e.address: e for e in service._endpoints("")}


def test_figures_never_read_are_unset_and_the_last_scrape_error_is_given() -> None:
    store = SignalStore()
    now = time.monotonic()
    idle = ServerSample("vllm", running=0, waiting=0)  # no KV gauge on this page
    store.record_scrape(("m", READ), ScrapeResult(200, sample=idle), now)
    page = "# TYPE node_cpu_seconds_total counter\nnode_cpu_seconds_total 1\n"
    store.record_scrape(("m", NO_DIALECT), ScrapeResult(200, metrics_text=page), now)
    eps = listed(store)
    read = eps[READ]
    assert read.HasField("running") and read.HasField("waiting") and (read.running, read.waiting) == (0, 0)
    assert not read.HasField("kv_use") and not read.HasField("error_rate")
    assert read.scrape_error == "" and read.scrape_error_reason == ""
    for e in (eps[NEVER], eps[NO_DIALECT]):
        for name in ("running", "waiting", "kv_use", "latency_seconds", "error_rate"):
            assert not e.HasField(name), (e.address, name)
    bad = eps[NO_DIALECT]
    assert bad.sight == "SEEN" and bad.scrape_error_reason == "no_dialect"
    assert "no vLLM, SGLang, TGI, Triton or llama.cpp metrics on the page" in bad.scrape_error


def test_prefill_and_decode_times_are_listed_once_two_pages_show_them() -> None:
    store = SignalStore()
    now = time.monotonic()
    first = ServerSample(
        "vllm", running=0, waiting=0, prompt_tokens=600, prompt_seconds=1.2, decode_sum_s=5, decode_count=10
    )
    store.record_scrape(("m", READ), ScrapeResult(200, sample=first), now)
    assert not listed(store)[READ].HasField("prefill_seconds_per_token")  # one page: no interval yet
    later = ServerSample(
        "vllm", running=0, waiting=0, prompt_tokens=1600, prompt_seconds=1.7, decode_sum_s=9, decode_count=20
    )
    store.record_scrape(("m", READ), ScrapeResult(200, sample=later), now + 1)
    read = listed(store)[READ]
    assert read.prefill_seconds_per_token == pytest.approx(0.0005)
    assert read.decode_seconds_per_request == pytest.approx(0.4)
    assert not listed(store)[NEVER].HasField("decode_seconds_per_request")


def test_lora_adapters_are_listed_where_known_and_unset_where_not() -> None:
    store = SignalStore()
    now = time.monotonic()
    held = ServerSample(
        "vllm", running=2, waiting=1, lora_running=("sql", "chat"), lora_waiting=("x",), max_lora=4
    )
    store.record_scrape(("m", READ), ScrapeResult(200, sample=held), now)
    # Known to hold none: max_adapters set, the lists empty.
    empty = ServerSample("vllm", running=0, waiting=0, lora_running=(), lora_waiting=(), max_lora=2)
    store.record_scrape(("m", NO_DIALECT), ScrapeResult(200, sample=empty), now)
    eps = listed(store)
    read = eps[READ]
    assert (list(read.running_adapters), list(read.waiting_adapters), read.max_adapters) == (
        ["sql", "chat"],
        ["x"],
        4,
    )
    assert eps[NO_DIALECT].HasField("max_adapters") and eps[NO_DIALECT].max_adapters == 2
    assert not eps[NO_DIALECT].running_adapters and not eps[NO_DIALECT].waiting_adapters
    never = eps[NEVER]
    assert not never.HasField("max_adapters") and not never.running_adapters and not never.waiting_adapters
    # Through the wire format and back: the same.
    again = endpoint_pb2.Endpoint.FromString(read.SerializeToString())
    assert list(again.running_adapters) == ["sql", "chat"] and again.max_adapters == 4
