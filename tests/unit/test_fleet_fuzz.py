"""Property-based fuzzing of the fleet loader (issue 16): whatever the text, the loader gives
a valid fleet or a precise FleetConfigInvalid, never another exception. Inputs are built
from the fleet's own vocabulary (keys, values, YAML punctuation) around a valid file, so the
search reaches deep into the validation rather than stopping at the YAML parser."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from controlplane.fleet import FleetConfigInvalid, parse_fleet
from controlplane.fleet.model import Fleet
from tests.fleets import BASIC

KEYS = [
    "listener", "port", "address", "tiers", "small", "max_params_b", "timeout", "retries",
    "circuit_breakers", "default", "max_requests", "outlier_detection", "consecutive_5xx",
    "balancing", "models", "m", "params_b", "tier", "stable", "versions", "v1", "v2",
    "endpoints", "gpu", "capacity", "zone", "health", "http", "grpc", "path", "service",
    "metrics", "scheme", "signals", "interval", "source", "prometheus", "url", "gpu_classes",
    "memory_gb", "priority_classes", "shed_at", "affinity", "header", "body", "zones",
    "cluster_overrides", "protocol", "dtype", "preferred_gpus",
]  # fmt: skip
VALUES = [
    "1", "0", "-1", "8", "1.5", ".nan", ".inf", "-.inf", "1e308", "1.0e+308", "true", "no", "~",
    "''", "'127.0.0.1:8000'", "'[::1]:1'", "'[::ffff:127.0.0.1]:8000'", "60s", "1ms", "0s",
    "720h", "999999999h", "none", "http2", "fp8", "/x", "x", "[]", "{}", "[1, 2]", "{a: 1}",
    "&a 1", "*a", "!!binary aGk=", "!!python/none", "'\\u0000'", "\"\\t\"", "١٢",
]  # fmt: skip
# More examples for a long fuzzing run: FUZZ_EXAMPLES=20000 pytest tests/unit/test_fleet_fuzz.py
N = int(os.environ.get("FUZZ_EXAMPLES", "300"))
PUNCT = [": ", "\n", "  ", "- ", "{", "}", "[", "]", ", ", "#", "&x ", "*x", "'", '"', "? "]

token = st.one_of(st.sampled_from(KEYS), st.sampled_from(VALUES), st.sampled_from(PUNCT))
noise = st.lists(token, max_size=40).map("".join)


def verdict(text: str) -> Fleet | FleetConfigInvalid:
    try:
        return parse_fleet(text, "fuzz.yaml")
    except FleetConfigInvalid as e:
        assert e.errors and all(str(x) for x in e.errors)
        return e


@settings(max_examples=N, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(noise)
@example("models: {1: {}}\ntiers: {small: {}}\nlistener: {port: 1}\n")
@example("tiers: {small: {max_params_b: .nan}}\nmodels: {m: {params_b: 1}}\nlistener: {port: 1}\n")
def test_any_text_gets_a_verdict(text: str) -> None:
    verdict(text)


@settings(max_examples=N, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(BASIC)), st.integers(0, 40), noise)
def test_a_valid_file_edited_anywhere_gets_a_verdict(at: int, cut: int, inserted: str) -> None:
    verdict(BASIC[:at] + inserted + BASIC[at + cut :])


@settings(max_examples=N, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["params_b: 8", "stable: v1", "small:  {max_params_b: 15, timeout: 60s}",
                        "{address: 127.0.0.1:8102}", "listener: {port: 10000}"]),
       st.sampled_from(KEYS), st.sampled_from(VALUES))  # fmt: skip
def test_one_value_replaced_gets_a_verdict(line: str, key: str, value: str) -> None:
    key_part = line.split(":")[0]
    verdict(BASIC.replace(line, f"{key_part}: {value}", 1))
    verdict(BASIC.replace(line, f"{line}\n    {key}: {value}", 1))
