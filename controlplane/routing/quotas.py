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
"""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2, grpc_service_pb2
from envoy.config.ratelimit.v3 import rls_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.type.metadata.v3 import metadata_pb2
from envoy.type.v3 import http_status_pb2

from controlplane.fleet.model import Fleet, Model, QuotaSpec
from controlplane.resources import names
from controlplane.resources.names import METADATA_NS
from controlplane.routing import pb
from controlplane.routing.clusters import build_side_service_cluster

RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
DOMAIN = "inference"  # the rate-limit domain every descriptor is under
MODEL_KEY = "model"  # descriptor entry keys
TENANT_KEY = "tenant"
BEARER_KEY = "bearer"  # key.bearer: the Authorization header as sent; the service hashes it
KIND_KEY = "kind"  # absent: requests; "tokens": the token check; "charge": a response's tokens
USAGE_KEY = "usage"  # the response's usage.total_tokens (json_to_metadata), at stream end
PROMPT_BYTES_KEY = "prompt_bytes"  # the request's content-length
MAX_TOKENS_KEY = "max_tokens"  # the request's max_tokens (json_to_metadata)
REFUSED_KEY = "refused"  # "yes" on a request the service refused (its dynamic metadata)
USAGE_METADATA = "usage_total_tokens"  # keys in the controlplane metadata namespace
MAX_TOKENS_METADATA = "max_tokens"


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


def build_ratelimit_cluster(quotas: QuotaSpec) -> cluster_pb2.Cluster:
    """The rate-limit services as proxies reach them (clusters.build_side_service_cluster)."""
    return build_side_service_cluster(names.RATELIMIT_CLUSTER, quotas.endpoints, quotas.service_tls)


def counts_tokens(quotas: QuotaSpec) -> bool:
    """Whether any level sets tokens_per_minute (else no token check, no charge)."""
    levels = [quotas.default, *quotas.tenants.values()]
    for model_default, model_tenants in quotas.models.values():
        levels += [model_default, *model_tenants.values()]
    return any(level.tokens_per_minute is not None for level in levels)


def add_rate_limits(fleet: Fleet, model: Model, action: route_components_pb2.RouteAction) -> None:
    """The model route's descriptors, each starting (model, its name), (tenant, the key header)
    if sent: the request check; with token quotas, the token check, (kind, tokens); and, when
    the stream is done, the charge: (kind, charge), (usage, the response's
    usage.total_tokens), (prompt_bytes, its content-length), (max_tokens, the request's)."""
    quotas = fleet.quotas
    if quotas is None:
        return
    Action = route_components_pb2.RateLimit.Action

    def who() -> list[route_components_pb2.RateLimit.Action]:
        return [
            Action(generic_key=Action.GenericKey(descriptor_key=MODEL_KEY, descriptor_value=model.name)),
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

    action.rate_limits.add(actions=who())
    if not counts_tokens(quotas):
        return
    kind = Action(generic_key=Action.GenericKey(descriptor_key=KIND_KEY, descriptor_value="tokens"))
    action.rate_limits.add(actions=[*who(), kind])
    charge = Action(generic_key=Action.GenericKey(descriptor_key=KIND_KEY, descriptor_value="charge"))
    action.rate_limits.add(
        apply_on_stream_done=True,
        actions=[
            *who(),
            charge,
            metadata(USAGE_METADATA, USAGE_KEY),
            Action(
                request_headers=Action.RequestHeaders(
                    header_name="content-length", descriptor_key=PROMPT_BYTES_KEY, skip_if_absent=True
                )
            ),
            metadata(MAX_TOKENS_METADATA, MAX_TOKENS_KEY),
            # The service's own mark on a request it refused (its answer's dynamic metadata):
            # a 429 costs no tokens.
            metadata(REFUSED_KEY, REFUSED_KEY, namespace=RATELIMIT_FILTER),
        ],
    )
