"""Envoy's side of per-tenant quotas (fleet `quotas:`, docs/quotas.md): the rate-limit filter,
the cluster of the rate-limit services, and each model route's descriptor.

Every request of a model asks the rate-limit service (`controlplane ratelimit`, Envoy's
`envoy.service.ratelimit.v3` protocol) with one descriptor: the model, then the tenant (the
key header's value; absent, the entry is left out and the service applies the default
limits). The service answers OK or OVER_LIMIT, with the x-ratelimit-* headers for either and,
over the limit, the OpenAI-style error body; Envoy answers that request 429 itself. A service
that is down, slow past quotas.service.timeout or failing costs nothing by default (the
request is served: fail open, counted in Envoy's `ratelimit.error` and
`ratelimit.failure_mode_allowed`), or a 500 with `on_error: deny`.

With token limits, each response is charged when it ends (`apply_on_stream_done`): with its
usage (a JSON answer's, read by json_to_metadata; a stream's usage event, read by the Lua
filter here as the stream passes), else with what the request let the server send (its
output limits, whatever its dialect calls them, and how many completions it asked for).

An adapter named under quotas.models has limits of its own on top of its base model's: on the
routes that take the model's adapters' names, each descriptor comes twice, first with (adapter,
the name the request gave) after the model (the adapter's), then as for the base model. The
service ignores the adapter's descriptor of an adapter without limits of its own, so such an
adapter counts as its base model only.
"""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2, config_source_pb2, grpc_service_pb2
from envoy.config.ratelimit.v3 import rls_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.type.metadata.v3 import metadata_pb2
from envoy.type.v3 import http_status_pb2

from controlplane.fleet.model import Fleet, Model, QuotaSpec
from controlplane.resources import names
from controlplane.resources.names import METADATA_NS, MODEL_HEADER
from controlplane.routing import pb
from controlplane.routing.clusters import build_side_service_cluster

RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
DOMAIN = "inference"  # the rate-limit domain every descriptor is under
MODEL_KEY = "model"  # descriptor entry keys
TENANT_KEY = "tenant"
ADAPTER_KEY = "adapter"  # the adapter the request named (routes that take adapters' names)
BEARER_KEY = "bearer"  # key.bearer: the Authorization header as sent; the service hashes it
KIND_KEY = "kind"  # absent: requests; "tokens": the token check; "charge": a response's tokens
USAGE_KEY = "usage"  # the response's usage.total_tokens (json_to_metadata), at stream end
PROMPT_BYTES_KEY = "prompt_bytes"  # the request's content-length
MAX_TOKENS_KEY = "max_tokens"  # the request's max_tokens (json_to_metadata)
REFUSED_KEY = "refused"  # "yes" on a request the service refused (its dynamic metadata)
USAGE_METADATA = "usage_total_tokens"  # keys in the controlplane metadata namespace
MAX_TOKENS_METADATA = "max_tokens"
# The request's limits on what the server may send, by descriptor key (also the metadata key
# json_to_metadata writes, with an "out_" in front) -> where the body says it. The charge takes
# the largest of those sent (a server honours the one its dialect reads: OpenAI-style ones let
# max_completion_tokens win over max_tokens), times the most completions asked for.
OUTPUT_LIMIT_FIELDS: dict[str, tuple[str, ...]] = {
    MAX_TOKENS_KEY: ("max_tokens",),  # OpenAI, vLLM, SGLang, TGI's and llama.cpp's OpenAI APIs
    "max_completion_tokens": ("max_completion_tokens",),  # OpenAI's newer name
    "max_output_tokens": ("max_output_tokens",),  # OpenAI's Responses API
    "max_new_tokens": ("parameters", "max_new_tokens"),  # TGI's /generate
    "sampling_max_new_tokens": ("sampling_params", "max_new_tokens"),  # SGLang's /generate
    "parameters_max_tokens": ("parameters", "max_tokens"),  # Triton's generate extension
    "n_predict": ("n_predict",),  # llama.cpp's /completion
}
COPIES_FIELDS: dict[str, tuple[str, ...]] = {
    "n": ("n",),  # completions returned
    "best_of": ("best_of",),  # completions generated (OpenAI's legacy completions, vLLM)
    "parameters_best_of": ("parameters", "best_of"),  # TGI's /generate
}


def output_metadata_key(descriptor_key: str) -> str:
    """The dynamic-metadata key json_to_metadata writes a request's output limit to."""
    return MAX_TOKENS_METADATA if descriptor_key == MAX_TOKENS_KEY else f"out_{descriptor_key}"


# A streamed answer's usage, read as it passes (Envoy's Lua filter, `bodyChunks()`: each chunk
# is seen and let go at once, nothing is buffered, the stream is not held). OpenAI-style
# servers send it in a last event when the request asks (`stream_options.include_usage`);
# vLLM with continuous usage stats in every event (the last one counts). A JSON string inside
# an answer has its quotes escaped, so generated text cannot forge `"total_tokens":`. The
# last 64 bytes of each chunk are kept to find a number cut between two chunks. Without one,
# nothing is set and the service estimates.
STREAM_USAGE_LUA = """
function envoy_on_response(handle)
  local ct = handle:headers():get("content-type")
  if ct == nil or string.find(string.lower(ct), "text/event-stream", 1, true) == nil then
    return
  end
  local tail, total = "", nil
  for chunk in handle:bodyChunks() do
    local n = chunk:length()
    if n > 0 then
      local text = tail .. chunk:getBytes(0, n)
      if string.find(text, "total_tokens", 1, true) ~= nil then
        for v in string.gmatch(text, '"total_tokens"%s*:%s*(%d+)') do
          total = v
        end
      end
      tail = string.sub(text, -64)
    end
  end
  if total ~= nil then
    handle:streamInfo():dynamicMetadata():set("NAMESPACE", "KEY", total)
  end
end
"""
STREAM_USAGE_FILTER = "controlplane.quota.stream_usage"  # a Lua filter's name in the chain


def build_ratelimit_filter(quotas: QuotaSpec) -> hcm_pb2.HttpFilter:
    cfg = rate_limit_pb2.RateLimit(
        domain=DOMAIN,
        request_type="external",
        timeout=pb.duration(quotas.timeout_s),
        failure_mode_deny=quotas.failure_mode_deny,
        rate_limit_service=rls_pb2.RateLimitServiceConfig(
            grpc_service=grpc_service_pb2.GrpcService(
                envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=names.RATELIMIT_CLUSTER),
                timeout=pb.duration(quotas.timeout_s),
            ),
            transport_api_version=config_source_pb2.V3,
        ),
        rate_limited_status=http_status_pb2.HttpStatus(code=http_status_pb2.TooManyRequests),
        stat_prefix="quota",
    )
    return hcm_pb2.HttpFilter(name=RATELIMIT_FILTER, typed_config=pb.pack(cfg))


def build_stream_usage_filter() -> hcm_pb2.HttpFilter:
    """Envoy's Lua filter with STREAM_USAGE_LUA: a streamed answer's usage.total_tokens into
    the metadata the charge reads (a JSON answer's is read by json_to_metadata)."""
    source = STREAM_USAGE_LUA.replace("NAMESPACE", METADATA_NS).replace("KEY", USAGE_METADATA)
    cfg = lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=source))
    return hcm_pb2.HttpFilter(name=STREAM_USAGE_FILTER, typed_config=pb.pack(cfg))


def build_ratelimit_cluster(quotas: QuotaSpec) -> cluster_pb2.Cluster:
    """The rate-limit services as proxies reach them (clusters.build_side_service_cluster)."""
    return build_side_service_cluster(names.RATELIMIT_CLUSTER, quotas.endpoints, quotas.service_tls)


def counts_tokens(quotas: QuotaSpec) -> bool:
    """Whether any level sets tokens_per_minute (else no token check, no charge)."""
    levels = [quotas.default, *quotas.tenants.values()]
    for model_default, model_tenants in quotas.models.values():
        levels += [model_default, *model_tenants.values()]
    return any(level.tokens_per_minute is not None for level in levels)


def limited_adapters(fleet: Fleet) -> dict[str, str]:
    """Adapter -> its base model, for every adapter quotas.models names (an adapter with limits
    of its own); empty without quotas."""
    return {a: m.name for m in fleet.models for a in own_limited_adapters(fleet, m)}


def own_limited_adapters(fleet: Fleet, model: Model) -> list[str]:
    """The names of `model`'s adapters that quotas.models names (cheap: the model's adapters)."""
    if fleet.quotas is None:
        return []
    return [a.name for a in model.adapters if a.name in fleet.quotas.models]


def add_rate_limits(
    fleet: Fleet,
    model: Model,
    action: route_components_pb2.RouteAction,
    adapter_key: str | None = None,
) -> None:
    """The model route's descriptors, each starting (model, its name), (tenant, the key header)
    if sent: the request check; with token quotas, the token check, (kind, tokens); and, when
    the stream is done, the charge: (kind, charge), (usage, the response's
    usage.total_tokens, a JSON answer's or a stream's usage event's), (prompt_bytes, its
    content-length), then each output limit and count of completions the request may carry
    (OUTPUT_LIMIT_FIELDS, COPIES_FIELDS; "none" where it sent none), (refused, ...).

    `adapter_key`: the route takes the model's adapters' names, from the x-model header
    ("header") or the body's model ("body"). When quotas name one of the model's adapters,
    each check (and charge, where an adapter sets tokens) comes first with (adapter, that
    name) after the model: the adapter's own limits, which the service looks up by the name
    (and ignores for an adapter without limits of its own)."""
    quotas = fleet.quotas
    if quotas is None:
        return
    Action = route_components_pb2.RateLimit.Action
    own = own_limited_adapters(fleet, model) if adapter_key is not None else []
    if adapter_key is None or not own:
        adapter: route_components_pb2.RateLimit.Action | None = None
    elif adapter_key == "header":
        adapter = Action(
            request_headers=Action.RequestHeaders(header_name=MODEL_HEADER, descriptor_key=ADAPTER_KEY)
        )
    else:  # the route matched the body's model (json_to_metadata's), so it is there
        adapter = Action(
            metadata=Action.MetaData(
                descriptor_key=ADAPTER_KEY,
                metadata_key=metadata_pb2.MetadataKey(
                    key=METADATA_NS, path=[metadata_pb2.MetadataKey.PathSegment(key=MODEL_KEY)]
                ),
                source=Action.MetaData.DYNAMIC,
            )
        )
    adapter_tokens = adapter is not None and any(
        level.tokens_per_minute is not None
        for name in own
        for level in (quotas.models[name][0], *quotas.models[name][1].values())
    )

    def who(of_adapter: bool = False) -> list[route_components_pb2.RateLimit.Action]:
        return [
            Action(generic_key=Action.GenericKey(descriptor_key=MODEL_KEY, descriptor_value=model.name)),
            *([adapter] if of_adapter and adapter is not None else []),
            Action(
                request_headers=Action.RequestHeaders(
                    header_name="authorization" if quotas.key_bearer else quotas.key_header,
                    descriptor_key=BEARER_KEY if quotas.key_bearer else TENANT_KEY,
                    skip_if_absent=True,
                )
            ),
        ]

    def metadata(
        key: str, descriptor: str, namespace: str = METADATA_NS
    ) -> route_components_pb2.RateLimit.Action:
        return Action(
            metadata=Action.MetaData(
                descriptor_key=descriptor,
                metadata_key=metadata_pb2.MetadataKey(
                    key=namespace, path=[metadata_pb2.MetadataKey.PathSegment(key=key)]
                ),
                # Never empty: Envoy drops a descriptor with an empty entry, and a charge
                # dropped is a free pass. "none": the service estimates.
                default_value="none",
                source=Action.MetaData.DYNAMIC,
            )
        )

    # The adapter's first (its name in the 429's message when both are out); the service takes
    # from no bucket unless every one of the call's has room.
    if adapter is not None:
        action.rate_limits.add(actions=who(of_adapter=True))
    action.rate_limits.add(actions=who())
    if not counts_tokens(quotas):
        return
    kind = Action(generic_key=Action.GenericKey(descriptor_key=KIND_KEY, descriptor_value="tokens"))
    if adapter_tokens:
        action.rate_limits.add(actions=[*who(of_adapter=True), kind])
    action.rate_limits.add(actions=[*who(), kind])
    charge = Action(generic_key=Action.GenericKey(descriptor_key=KIND_KEY, descriptor_value="charge"))
    for of_adapter in (True, False) if adapter_tokens else (False,):
        action.rate_limits.add(
            apply_on_stream_done=True,
            actions=[
                *who(of_adapter),
                charge,
                metadata(USAGE_METADATA, USAGE_KEY),
                Action(
                    request_headers=Action.RequestHeaders(
                        header_name="content-length", descriptor_key=PROMPT_BYTES_KEY, skip_if_absent=True
                    )
                ),
                *(metadata(output_metadata_key(key), key) for key in (*OUTPUT_LIMIT_FIELDS, *COPIES_FIELDS)),
                # The service's own mark on a request it refused (its answer's dynamic metadata):
                # a 429 costs no tokens.
                metadata(REFUSED_KEY, REFUSED_KEY, namespace=RATELIMIT_FILTER),
            ],
        )
