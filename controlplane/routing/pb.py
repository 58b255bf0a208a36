"""Protobuf building blocks shared by the translation modules (pure)."""

from __future__ import annotations

from envoy.config.core.v3 import config_source_pb2
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message


def duration(seconds: float) -> duration_pb2.Duration:
    """A Duration of `seconds`, to the nanosecond."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def pack(msg: Message) -> any_pb2.Any:
    """`msg` in an Any."""
    a = any_pb2.Any()
    a.Pack(msg)
    return a


def ads() -> config_source_pb2.ConfigSource:
    """The ADS stream the resource came on."""
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        resource_api_version=config_source_pb2.V3,
    )


def self_source() -> config_source_pb2.ConfigSource:
    """The xDS server itself: where proxyless gRPC clients send their load reports (the only
    LRS server they accept). Envoy ignores a cluster's lrs_server (its bootstrap names one)."""
    return config_source_pb2.ConfigSource(
        self=config_source_pb2.SelfConfigSource(), resource_api_version=config_source_pb2.V3
    )
