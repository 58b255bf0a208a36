"""Pure: what an ext_proc request-headers message asks the picker, read within bounds.

Envoy sends, with a request's headers: the cluster its route chose (the `xds.cluster_name`
attribute), the gateway's metadata (the prefix key, for models with prefix affinity) and
perhaps a subset hint (the Endpoint Picker Protocol's `envoy.lb.subset_hint` metadata, or
the `x-gateway-destination-endpoint-subset` header). Anyone who reaches the port can send
anything, so each input has a bound (controlplane/limits.py), and an input past its bound is
refused the same way everywhere: no pick (Envoy routes the request by the weights), the
input named in `Refused`, which the service counts
(`controlplane_picker_inputs_refused_total{input}`). Nothing is cut short: a cut prefix key
would send a request to another prompt's server, a cut subset hint would widen it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from controlplane import limits
from controlplane.resources.names import METADATA_NS, MODEL_HEADER, SUBSET_METADATA_NS

CLUSTER_ATTRIBUTE = "xds.cluster_name"
SERVED_ATTRIBUTE = "upstream.address"  # sent with the response headers: where the request went
PREFIX_KEY = "affinity_prefix"  # the prefix key the gateway's Lua filter sets (routing/prefix_key.lua)
PROMPT_KEY = "prompt"  # the request body, for a picked model with a tokenizer (the same filter)
SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
REQUEST_ID_MAX_CHARS = 128  # a request id as logged (debug): a 3 MB header is not a log line

# The inputs a bound applies to, as counted (the `input` label).
CLUSTER, PREFIX, SUBSET, PROMPT = "cluster", "prefix_key", "subset_hint", "prompt"
INPUTS = (CLUSTER, PREFIX, SUBSET, PROMPT)


@dataclass(frozen=True)
class Ask:
    """What a request asks: pick in `cluster` ("" if Envoy sent none), near `prefix` ("" if
    none), among `subset` only (None: no hint)."""

    cluster: str
    prefix: str = ""
    subset: frozenset[str] | None = None
    request_id: str = ""
    prompt: str = ""  # the request body, where the gateway sent it (a model with a tokenizer)
    model: str = ""  # the model the request names (x-model, else the body's): an adapter's name, maybe
    adapter: str = ""  # `model`, where it is one of the cluster's adapters (the service sets it)


class Refused(NamedTuple):
    """An input past its bound: which (one of INPUTS), and why (a line naming the bound)."""

    input: str
    reason: str


def read_ask(req: ep.ProcessingRequest) -> Ask | Refused:
    """The request-headers message `req` as an Ask, or the first input past its bound."""
    cluster = attribute(req, CLUSTER_ATTRIBUTE)
    if len(cluster) > limits.PICKER_CLUSTER_MAX_CHARS:
        return Refused(CLUSTER, f"{len(cluster)} characters, more than {limits.PICKER_CLUSTER_MAX_CHARS}")
    prefix = _metadata(req, METADATA_NS, PREFIX_KEY)
    # Characters first: never encode a key already too long to keep (each is 1 to 4 bytes).
    if len(prefix) > limits.PICKER_PREFIX_KEY_MAX_BYTES or (
        len(prefix) * 4 > limits.PICKER_PREFIX_KEY_MAX_BYTES
        and len(prefix.encode(errors="surrogatepass")) > limits.PICKER_PREFIX_KEY_MAX_BYTES
    ):
        return Refused(PREFIX, f"more than {limits.PICKER_PREFIX_KEY_MAX_BYTES} bytes")
    subset = _subset(req)
    if isinstance(subset, Refused):
        return subset
    prompt = _metadata(req, METADATA_NS, PROMPT_KEY)
    if len(prompt) > limits.PICKER_PROMPT_MAX_BYTES:  # characters: at least as many bytes
        return Refused(PROMPT, f"more than {limits.PICKER_PROMPT_MAX_BYTES} bytes")
    request_id = header_bytes(req, "x-request-id")[:REQUEST_ID_MAX_CHARS]
    # The name the route matched (x-model first, as the routes): one no route takes is longer
    # than any fleet name, and names nothing here.
    model = header(req, MODEL_HEADER) or _metadata(req, METADATA_NS, "model")
    if len(model) > limits.API_NAME_MAX_CHARS:
        model = ""
    return Ask(cluster, prefix, subset, request_id.decode(errors="replace"), prompt, model)


def attribute(req: ep.ProcessingRequest, key: str) -> str:
    """An attribute Envoy sent with the request (keyed by the filter's name), "" if none."""
    for attrs in req.attributes.values():
        value = attrs.fields.get(key)
        if value is not None and value.HasField("string_value"):
            return str(value.string_value)
    headers = req.request_headers
    for attr in getattr(headers, "attributes", {}).values():  # older Envoys put them here
        value = attr.fields.get(key)
        if value is not None and value.HasField("string_value"):
            return str(value.string_value)
    return ""


def _metadata(req: ep.ProcessingRequest, namespace: str, key: str) -> str:
    """A string Envoy forwarded from the request's dynamic metadata, "" if none."""
    return metadata_string(req.metadata_context, namespace, key)


def metadata_string(metadata: base_pb2.Metadata, namespace: str, key: str) -> str:
    """A string in a Metadata message (a request's, an EDS endpoint's, a cluster's), "" if none."""
    ns = metadata.filter_metadata.get(namespace)
    if ns is None:
        return ""
    value = ns.fields.get(key)
    return str(value.string_value) if value is not None and value.HasField("string_value") else ""


def _too_big(n_bytes: int, n_addresses: int) -> Refused | None:
    if n_bytes > limits.PICKER_SUBSET_MAX_BYTES:
        return Refused(SUBSET, f"more than {limits.PICKER_SUBSET_MAX_BYTES} bytes")
    if n_addresses > limits.PICKER_SUBSET_MAX_ADDRESSES:
        return Refused(SUBSET, f"{n_addresses} addresses, more than {limits.PICKER_SUBSET_MAX_ADDRESSES}")
    return None


def _subset(req: ep.ProcessingRequest) -> frozenset[str] | Refused | None:
    """The subset hint: the servers the request may go to, from the `envoy.lb.subset_hint`
    metadata (a list, or a comma-separated string) or the header; None when the request
    names none; Refused past PICKER_SUBSET_MAX_BYTES or PICKER_SUBSET_MAX_ADDRESSES."""
    ns = req.metadata_context.filter_metadata.get(SUBSET_METADATA_NS)
    value = ns.fields.get(SUBSET_HEADER) if ns is not None else None
    if value is not None and value.HasField("list_value"):
        values = value.list_value.values
        if (refused := _too_big(0, len(values))) is not None:
            return refused
        found = [v.string_value for v in values if v.HasField("string_value")]
        if (refused := _too_big(sum(len(a) for a in found), len(found))) is not None:
            return refused
    else:
        if value is not None and value.HasField("string_value"):
            raw = value.string_value.encode(errors="surrogatepass")
        else:
            raw = header_bytes(req, SUBSET_HEADER)
        if (refused := _too_big(len(raw), 0)) is not None:
            return refused
        found = raw.decode(errors="replace").split(",")
        if (refused := _too_big(0, len(found))) is not None:
            return refused
    subset = frozenset(a.strip() for a in found if a.strip())
    return subset or None


def header_bytes(req: ep.ProcessingRequest, name: str) -> bytes:
    """A request header's value as sent, b"" if absent (the first, if sent twice)."""
    return map_header_bytes(req.request_headers.headers, name)


def map_header_bytes(headers: base_pb2.HeaderMap, name: str) -> bytes:
    """A header's value in an ext_proc header map (a request's or a response's), b"" if absent."""
    for h in headers.headers:
        if h.key == name:
            return bytes(h.raw_value) if h.raw_value else h.value.encode(errors="surrogatepass")
    return b""


def header(req: ep.ProcessingRequest, name: str) -> str:
    """A request header's value as text, "" if absent."""
    return header_bytes(req, name).decode(errors="replace")
