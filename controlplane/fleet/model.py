"""The fleet as configured: tiers, models, versions and the endpoints serving them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any


def format_address(host: str, port: int) -> str:
    """`IP:PORT`, with an IPv6 host in brackets: how endpoints are named everywhere."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Endpoint:
    """One inference server (a GPU server) serving one model version."""

    host: str
    port: int
    gpu: str | None = None
    gpu_memory_gb: float | None = None
    capacity: float | None = None  # relative throughput; None: the GPU class's (or 1.0)
    zone: str | None = None  # where it runs (an edge site, a cloud zone); EDS locality
    region: str | None = None
    kv_events: str | None = None  # its KV-event publisher: tcp://HOST:PORT or ipc://PATH
    kv_replay: str | None = None  # its publisher's replay socket

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)


@dataclass(frozen=True)
class KvEventPorts:
    """A version's or model's `kv_events: {port, replay_port}`: each endpoint's publisher is on
    its own host at `port` (for endpoints from discovery, whose addresses are not written)."""

    port: int
    replay_port: int | None = None


def kv_publisher(ep: Endpoint, *ports: KvEventPorts | None) -> tuple[str, str | None] | None:
    """Where `ep` publishes its KV events, and its replay socket: its own `kv_events`, else
    its host at the first of `ports` given (its version's, then its model's); None: it does
    not publish."""
    if ep.kv_events:
        return ep.kv_events, ep.kv_replay
    given = next((p for p in ports if p is not None), None)
    if given is None:
        return None
    host = f"[{ep.host}]" if ":" in ep.host else ep.host
    replay = f"tcp://{host}:{given.replay_port}" if given.replay_port else None
    return f"tcp://{host}:{given.port}", replay


HEALTH_KINDS = ("http", "grpc", "none")
METRICS_SCHEMES = ("http", "https")


@dataclass(frozen=True)
class HealthProbe:
    """How the control plane asks a server whether it is ready.

    `http`: GET `path` (2xx ready, 404 no health endpoint: ready, anything else not ready);
    `grpc`: grpc.health.v1 Check(`service`) (SERVING ready, UNIMPLEMENTED: ready, anything
    else not ready); `none`: never asked (ready unless its metrics say otherwise).
    `port` None: the serving port."""

    kind: str = "http"
    path: str | None = None  # http; None: the fleet's signals.health_path
    service: str = ""  # grpc; "" asks about the server as a whole
    port: int | None = None


@dataclass(frozen=True)
class MetricsProbe:
    """Where a server's Prometheus page is: `scheme://host:port path` (port None: the serving
    port; path None: the fleet's signals.metrics_path). `enabled` False: not scraped."""

    enabled: bool = True
    path: str | None = None
    port: int | None = None
    scheme: str = "http"


DISCOVERY_KINDS = ("dns", "srv", "kubernetes")


@dataclass(frozen=True)
class Discover:
    """Where a version's endpoints come from instead of a list (controlplane/discovery/,
    docs/discovery.md). The endpoints found get `template`'s GPU, memory, capacity and place
    unless their source says otherwise (a pod's labels, a slice's zone)."""

    kind: str  # dns (A/AAAA records), srv (SRV records), kubernetes (EndpointSlices of selected pods)
    name: str = ""  # dns, srv: the name to resolve
    port: int | None = None  # dns: the servers' port; kubernetes: the port number (or port_name)
    port_name: str | None = None  # kubernetes: the EndpointSlice port's name
    namespace: str = ""  # kubernetes
    selector: str = ""  # kubernetes: a label selector of the model's pods
    template: Endpoint | None = None  # host/port unused

    def source(self) -> str:
        """How status and explain name it: dns:NAME, srv:NAME, kubernetes:NS/SELECTOR."""
        if self.kind == "kubernetes":
            return f"kubernetes:{self.namespace}/{self.selector}"
        return f"{self.kind}:{self.name}"


@dataclass(frozen=True)
class Version:
    """A model version and the endpoints that serve it (probes: the model's unless set).
    With `discover`, `endpoints` are what discovery found last (empty in the file's fleet)."""

    name: str
    endpoints: tuple[Endpoint, ...]
    health: HealthProbe | None = None
    metrics: MetricsProbe | None = None
    discover: Discover | None = None
    kv_events: KvEventPorts | None = None


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter served on its model's servers (`adapters:` under a model,
    docs/adapters.md): a request naming it is routed as its base model's, to the servers that
    may serve it, the ones holding it first."""

    name: str
    source: str | None = None  # where a server loads it from (a path or URI), for placement: dynamic
    versions: tuple[str, ...] = ()  # the base model's versions that may serve it; empty: all
    endpoints: tuple[str, ...] = ()  # the endpoints (ADDRESS:PORT) that may serve it; empty: all

    def may_serve(self, version: str, address: str) -> bool:
        """Whether a server of `version` at `address` may serve this adapter."""
        return (not self.versions or version in self.versions) and (
            not self.endpoints or address in self.endpoints
        )


# How adapters reach the servers: `static` (the servers were started with them, as vLLM's
# --lora-modules or llama.cpp's --lora), `dynamic` (the picker loads one onto a chosen server
# through vLLM's runtime API when a request for it finds no server that has it).
PLACEMENTS = ("static", "dynamic")


@dataclass(frozen=True)
class CircuitBreaker:
    """Envoy circuit-breaker thresholds for one routing priority of a cluster."""

    max_requests: int = 1024  # requests in flight to the cluster
    max_pending: int = 1024  # requests waiting for a connection


@dataclass(frozen=True)
class FlowControl:
    """A model's queue at the gateway while every one of its servers is full (`flow_control:`,
    docs/flow-control.md): kept by the pickers, ordered by priority class, then fair share
    between tenants, then arrival."""

    max_wait_s: float = 10.0  # the longest a request waits for a slot (every class not named below)
    max_wait_by_class: tuple[tuple[str, float], ...] = ()  # (priority class, its longest wait)
    max_requests: int = 1000  # requests waiting, per model and picker
    max_bytes: int = 64 << 20  # their bodies' bytes (Content-Length), per model and picker
    tenant_header: str | None = None  # None: the quotas' key header, else x-api-key

    def max_wait(self, priority_class: str) -> float:
        """The longest a request of `priority_class` waits."""
        return dict(self.max_wait_by_class).get(priority_class, self.max_wait_s)

    def longest_wait(self) -> float:
        return max([self.max_wait_s, *(s for _, s in self.max_wait_by_class)])


@dataclass(frozen=True)
class TrafficPolicy:
    """How a tier's models are served; each model inherits its tier's and may override keys."""

    timeout_s: float = 60.0  # the whole request, SSE included
    # The longest Envoy waits for the next bytes of a response, the response headers included
    # (a non-streamed completion sends nothing until it is done). None: the timeout.
    stream_idle_timeout_s: float | None = None
    retries: int = 2  # attempts after the first, each on another host
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    breaker_default: CircuitBreaker = field(default_factory=CircuitBreaker)
    breaker_high: CircuitBreaker = field(default_factory=CircuitBreaker)
    outlier_consecutive_5xx: int = 5  # 5xx answers in a row (507 included) that eject a host
    outlier_interval_s: float = 5.0
    outlier_base_ejection_s: float = 30.0
    outlier_max_ejection_percent: int = 50
    # Ejection by failure share in one interval: the rule proxyless gRPC clients apply (they
    # ignore consecutive 5xx, gRFC A50); Envoy applies it too. 0 turns it off.
    outlier_failure_percentage: int = 50
    outlier_failure_min_requests: int = 10  # a server's requests in the interval to be judged
    balancing: str = "adaptive"
    flow_control: FlowControl | None = None  # None: no queue at the gateway (docs/flow-control.md)


@dataclass(frozen=True)
class Slo:
    """A model's service-level objectives (docs/metrics.md#slos): what the burn-rate alerts
    measure its traffic against. Each objective is the share of requests that must be good."""

    availability: float = 0.999  # requests answered without a server error or a reset
    ttft_s: float = 2.5  # time to first token a request must be under ...
    ttft_objective: float = 0.99  # ... this share of the time
    tpot_s: float = 0.1  # time per output token (streaming) a request must be under ...
    tpot_objective: float = 0.99  # ... this share of the time


@dataclass(frozen=True)
class ScalingPolicy:
    """How many replicas a model wants, in the style of Knative's KPA (controlplane/autoscaling/,
    docs/autoscaling.md). Set per tier and per model (`autoscaling:`); the model's keys win."""

    min_replicas: int = 1  # 0 lets the model scale to zero once idle for idle_grace_s
    max_replicas: int = 100
    # Requests in flight or waiting per replica. None: its servers' slots (seen when they
    # queue) x target_utilization, else DEFAULT_TARGET_PER_REPLICA.
    target_per_replica: float | None = None
    target_utilization: float = 0.7
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    panic_threshold: float = 2.0  # panic when the panic window wants this many times the ready replicas
    scale_down_rate: float = 2.0  # one decision keeps at least 1/rate of the ready replicas
    scale_up_rate: float = 1000.0  # one decision adds at most (rate - 1) x the ready replicas
    hold_max: int = 100  # requests held at once while no server is ready; 0: refused at once (503)
    idle_grace_s: float = 20.0  # no demand at all for this long: inactive (KEDA), and zero wanted with min 0
    # Predictive pre-warm (autoscaling/forecast.py): learn demand by time of season and ask for
    # replicas a cold start ahead of a forecast rise. Off by default: it costs GPU-seconds.
    predictive: bool = False
    season_s: float = 86400.0  # the period demand repeats over
    forecast_bucket_s: float = 60.0  # history resolution
    forecast_method: str = "auto"  # auto (chosen by backtest), seasonal, holt_winters
    cold_start_s: float = 30.0  # the lead until a cold start has been observed


@dataclass(frozen=True)
class DiscoverySettings:
    """The fleet's `discovery:` keys (docs/discovery.md)."""

    nameservers: tuple[tuple[str, int], ...] = ()  # empty: the system resolver's
    dns_min_interval_s: float = 5.0  # re-resolve at the record's TTL, within these bounds
    dns_max_interval_s: float = 300.0
    kubeconfig: str | None = None  # None: in-cluster config, else $KUBECONFIG or ~/.kube/config
    gpu_label: str = "gpu"  # pod label or annotation keys carrying an endpoint's GPU facts
    gpu_memory_label: str = "gpu-memory-gb"
    capacity_label: str = "capacity"


DEFAULT_TARGET_PER_REPLICA = 8.0
FORECAST_METHODS = ("auto", "seasonal", "holt_winters")
PROVIDERS = ("none", "emulator")


@dataclass(frozen=True)
class EmulatedServer:
    """What the `emulator` provider starts for a replica (controlplane emulate's flags)."""

    cold_start_s: float = 5.0
    slots: int = 8
    decode_ms_per_token: float = 20.0
    speed: float = 1.0


@dataclass(frozen=True)
class ProviderSpec:
    """Who starts and stops replicas (fleet-level `autoscaling:`). `none`: your own tools
    (KEDA, the HPA) follow desired replicas; `emulator`: the control plane starts and stops
    emulated servers for every model's stable version itself (the demo, tests)."""

    provider: str = "none"
    emulator: EmulatedServer = field(default_factory=EmulatedServer)


@dataclass(frozen=True)
class Tier:
    """A model-size tier. Models up to `max_params_b` billion parameters belong to it."""

    name: str
    max_params_b: float | None
    policy: TrafficPolicy = field(default_factory=TrafficPolicy)
    scaling: ScalingPolicy = field(default_factory=ScalingPolicy)
    slo: Slo = field(default_factory=Slo)

    @property
    def timeout_s(self) -> float:
        return self.policy.timeout_s

    @property
    def balancing(self) -> str:
        return self.policy.balancing


@dataclass(frozen=True)
class Affinity:
    """Session or prompt-cache affinity: requests with the same key go to the same endpoint,
    by consistent hashing, until it carries more than `balance_factor` x the average load."""

    header: str | None = None  # e.g. x-session-id
    body_field: str | None = None  # e.g. prompt_cache_key or user, from the JSON body
    algorithm: str = "maglev"  # or ring_hash
    balance_factor: int = 150  # percent of the mean requests in flight per endpoint (>= 100)
    prefix: PrefixKey | None = None  # the key is the prompt's leading part (prefix affinity)
    # The key is the adapter a request names (its model name): each adapter's requests keep to
    # the servers that hold it, and the base model's, without a key, spread within the bound.
    # A model with adapters and no affinity of its own gets this one (ADAPTER_AFFINITY).
    adapter: bool = False


ADAPTER_AFFINITY = Affinity(adapter=True)


@dataclass(frozen=True)
class PrefixKey:
    """How Envoy derives a prefix-affinity key from a request body (routing/prefix_key.lua):
    for chat, the raw text of the first `messages` messages (the system prompt, then early
    turns), at most `max_bytes`; for completions, the first `prompt_bytes` of `prompt`."""

    messages: int = 1
    prompt_bytes: int = 1024
    max_bytes: int = 16384


@dataclass(frozen=True)
class Model:
    """A model: its tier, its versions, and the version that takes traffic (`stable`)."""

    name: str
    tier: str
    stable: str
    versions: tuple[Version, ...]
    params_b: float | None = None
    protocol: str = "http1"
    policy: TrafficPolicy | None = None  # the tier's, with this model's overrides; None: the tier's
    dtype: str = "fp16"  # weight precision, for the memory the model needs
    memory_gb: float | None = None  # GPU memory the model needs; None: derived from params_b and dtype
    preferred_gpus: tuple[str, ...] = ()  # GPU classes it should run on first
    affinity: Affinity | None = None
    zones: tuple[str, ...] = ()  # zones in order of preference: fall back down the list
    # Merged verbatim into every generated Cluster of this model; Envoy has the last word.
    cluster_overrides: Mapping[str, Any] | None = field(default=None, compare=True)
    health: HealthProbe | None = None  # None: gRPC health for protocol http2, else HTTP
    metrics: MetricsProbe | None = None  # None: the fleet's metrics_path on the serving port
    scaling: ScalingPolicy | None = None  # the tier's, with this model's overrides; None: the tier's
    slo: Slo | None = None  # the tier's, with this model's overrides; None: the tier's
    kv_events: KvEventPorts | None = None  # its servers' KV-event publishers' ports
    tokenizer: str | None = None  # a directory with its tokenizer.json (and tokenizer_config.json)
    adapters: tuple[Adapter, ...] = ()  # LoRA adapters served on its servers
    placement: str = "static"  # PLACEMENTS: how its adapters reach the servers

    @property
    def restricted_adapters(self) -> tuple[Adapter, ...]:
        """Its adapters that only some endpoints may serve (Adapter.endpoints): each one a
        subset of its clusters for Envoy (routing/clusters.adapter_subsets)."""
        return tuple(a for a in self.adapters if a.endpoints)

    def lb_adapters(self, version: Version) -> dict[str, tuple[str, ...]]:
        """Per endpoint address of `version`, the restricted adapters (restricted_adapters)
        that it may serve: Envoy's subsets for the no-hop path. Empty when the model has none."""
        restricted = self.restricted_adapters
        if not restricted:
            return {}
        return {
            ep.address: tuple(a.name for a in restricted if a.may_serve(version.name, ep.address))
            for ep in version.endpoints
        }

    def adapter(self, name: str) -> Adapter | None:
        """The adapter named `name`, None if this model has none so named."""
        return next((a for a in self.adapters if a.name == name), None)

    def version(self, name: str) -> Version:
        for v in self.versions:
            if v.name == name:
                return v
        raise KeyError(name)


@dataclass(frozen=True)
class ListenerSpec:
    """Where every Envoy listens for inference traffic."""

    port: int
    address: str = "127.0.0.1"


@dataclass(frozen=True)
class GpuClass:
    """A GPU class and its throughput relative to the others (capacity 1.0 = reference)."""

    name: str
    capacity: float = 1.0
    memory_gb: float | None = None  # GPU memory of a server of this class


# Bytes per parameter by weight precision; a model needs its weights plus MEMORY_OVERHEAD.
# The balancing policies a fleet may name (balancing.policies.POLICIES implements each).
POLICY_NAMES = (
    "adaptive",
    "round_robin",
    "least_request",
    "capacity",
    "least_connections",
    "weighted_response_time",
    "model_aware",
    # A per-request picker (controlplane picker, through Envoy's ext_proc) chooses the server;
    # the weights Envoy falls back to when it cannot are adaptive's.
    "picker",
)

DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
MEMORY_OVERHEAD = 1.2  # activations and a minimal KV cache on top of the weights


SIGNAL_SOURCES = ("scrape", "prometheus")  # where load signals come from (signals/source.py)


@dataclass(frozen=True)
class PrometheusSpec:
    """The Prometheus server the `prometheus` signal source asks (instant PromQL queries)."""

    url: str  # http(s)://HOST:PORT, maybe with a path prefix; no trailing slash
    interval_s: float = 2.0  # how often the queries run (weight rounds in between get nothing new)
    timeout_s: float = 1.0  # per query; a slow Prometheus delays a weight round at most this
    address_label: str = "instance"  # the series label that carries the endpoint's host:port


@dataclass(frozen=True)
class SignalsSpec:
    """How load signals are collected from the inference servers."""

    enabled: bool = True
    source: str = "scrape"  # one of SIGNAL_SOURCES
    prometheus: PrometheusSpec | None = None  # required when source is prometheus
    interval_s: float = 1.0  # scrape period, and the period weights are recomputed
    timeout_s: float = 0.5  # per endpoint and scrape; a slow server cannot delay the others
    metrics_path: str = "/metrics"
    health_path: str = "/health"
    stale_after_s: float = 5.0  # signals older than this start losing influence...
    stale_full_s: float = 30.0  # ...and have none left at this age (capacity only)
    slow_start_s: float = 30.0  # ramp to full weight after an endpoint becomes ready


@dataclass(frozen=True)
class PriorityClass:
    """A request class named by the x-priority header (QoS)."""

    name: str
    high: bool = False  # Envoy routing priority HIGH: its own circuit-breaker budget
    shed_at: float | None = None  # tier saturation at which it gets 429; None: never by signals


@dataclass(frozen=True)
class SideTls:
    """How proxies reach a side service (the pickers, the rate-limit services) over TLS: the
    files are paths on each proxy's own host (docs/picker.md#trust, docs/quotas.md#trust)."""

    ca: str  # the CA that signed the services' certificates: they are verified against it
    cert: str | None = None  # the proxy's client certificate, with `key`: mutual TLS
    key: str | None = None
    server_name: str | None = None  # sent as SNI; the services' certificate must carry it


@dataclass(frozen=True)
class PickerSpec:
    """The per-request endpoint pickers (`controlplane picker` processes) that proxies ask for
    models with `balancing: picker` (docs/picker.md)."""

    endpoints: tuple[tuple[str, int], ...] = ()  # where proxies reach the pickers
    # How long a proxy waits for a pick before it routes by the weights instead.
    timeout_s: float = 0.005
    tls: SideTls | None = None  # None: plaintext (pickers on loopback, or a trusted network)


@dataclass(frozen=True)
class QuotaLimit:
    """Per-minute limits of one tenant (or the default), on one model or all; None: not set
    here (the next broader level's applies; none at all: unlimited)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass(frozen=True)
class QuotaSpec:
    """The fleet's `quotas:` (docs/quotas.md): who a request belongs to, the limits, and where
    proxies reach the rate-limit service that counts them."""

    key_header: str = "x-api-key"  # the request header naming the tenant
    # key: {bearer: true}: the tenant is the Authorization bearer token, hashed
    # (quota/service.bearer_tenant), so that the fleet file never holds a credential.
    key_bearer: bool = False
    default: QuotaLimit = field(default_factory=QuotaLimit)
    tenants: Mapping[str, QuotaLimit] = field(default_factory=dict)
    # per model: (its default, its tenants)
    models: Mapping[str, tuple[QuotaLimit, Mapping[str, QuotaLimit]]] = field(default_factory=dict)
    endpoints: tuple[tuple[str, int], ...] = ()  # the rate-limit services (`controlplane ratelimit`)
    timeout_s: float = 0.02  # how long a proxy waits for a decision
    failure_mode_deny: bool = False  # the service unreachable: serve (fail open) unless set
    service_tls: SideTls | None = None  # None: plaintext (services on loopback, or a trusted network)

    def limit(self, tenant: str, model: str, kind: str) -> int | None:
        """The per-minute limit of `kind` (requests_per_minute, tokens_per_minute) for `tenant`
        on `model`: the most specific level that sets it (the model's tenant, the model's
        default, the tenant, the default), None when none does."""
        levels: list[QuotaLimit | None] = []
        if model in self.models:
            model_default, model_tenants = self.models[model]
            levels += [model_tenants.get(tenant), model_default]
        levels += [self.tenants.get(tenant), self.default]
        for level in levels:
            if level is not None and getattr(level, kind) is not None:
                return int(getattr(level, kind))
        return None


@dataclass(frozen=True)
class Fleet:
    """The whole configured world, as one immutable value."""

    listener: ListenerSpec
    tiers: tuple[Tier, ...]
    models: tuple[Model, ...]
    gpu_classes: tuple[GpuClass, ...] = ()
    signals: SignalsSpec = field(default_factory=SignalsSpec)
    priority_classes: tuple[PriorityClass, ...] = ()  # highest first
    default_priority_class: str | None = None  # for requests without (or with an unknown) x-priority
    autoscaling: ProviderSpec = field(default_factory=ProviderSpec)
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    picker: PickerSpec = field(default_factory=PickerSpec)
    quotas: QuotaSpec | None = None  # None: no quotas, no rate-limit filter

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def model(self, name: str) -> Model:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def adapter_of(self, name: str) -> tuple[Model, Adapter] | None:
        """The model serving the adapter named `name`, and the adapter; None if none is."""
        for m in self.models:
            if (a := m.adapter(name)) is not None:
                return m, a
        return None

    def traffic_of(self, model: Model) -> TrafficPolicy:
        """The traffic policy a model is served with: its tier's, with the model's overrides."""
        return model.policy or self.tier(model.tier).policy

    def scaling_of(self, model: Model) -> ScalingPolicy:
        """How a model scales: its tier's autoscaling, with the model's overrides."""
        return model.scaling or self.tier(model.tier).scaling

    def slo_of(self, model: Model) -> Slo:
        """A model's objectives: its tier's, with the model's overrides."""
        return model.slo or self.tier(model.tier).slo

    def policy_of(self, model: Model) -> str:
        """The balancing policy a model uses: its own, else its tier's."""
        return self.traffic_of(model).balancing

    def flow_control_of(self, model: Model) -> FlowControl | None:
        """The model's queue at the gateway (its own `flow_control`, else its tier's), None
        when it has none."""
        return self.traffic_of(model).flow_control

    def tenant_header(self, flow: FlowControl) -> str:
        """The header naming a request's tenant for `flow`: its own, else the quotas' key
        (not a bearer token: that is hashed by the rate-limit service), else x-api-key."""
        if flow.tenant_header:
            return flow.tenant_header
        if self.quotas is not None and not self.quotas.key_bearer:
            return self.quotas.key_header
        return "x-api-key"

    def picked(self, model: Model) -> bool:
        """Whether the model's requests ask a picker for their server."""
        return self.traffic_of(model).balancing == "picker" and bool(self.picker.endpoints)

    def capacity_of(self, endpoint: Endpoint) -> float:
        """An endpoint's relative capacity: its own, else its GPU class's, else 1.0."""
        declared = self.declared_capacity(endpoint)
        return 1.0 if declared is None else declared

    def gpu_memory_of(self, endpoint: Endpoint) -> float | None:
        """An endpoint's GPU memory in GB: its own, else its GPU class's; None if unknown."""
        if endpoint.gpu_memory_gb is not None:
            return endpoint.gpu_memory_gb
        return next((g.memory_gb for g in self.gpu_classes if g.name == endpoint.gpu), None)

    @staticmethod
    def memory_need_of(model: Model) -> float | None:
        """GPU memory the model needs: declared, else params_b x bytes per parameter x overhead."""
        if model.memory_gb is not None:
            return model.memory_gb
        if model.params_b is None:
            return None
        return model.params_b * DTYPE_BYTES[model.dtype] * MEMORY_OVERHEAD

    def fits(self, model: Model, endpoint: Endpoint) -> bool:
        """Whether the model fits the endpoint's GPU memory (unknown on either side: assume so)."""
        need, have = self.memory_need_of(model), self.gpu_memory_of(endpoint)
        return need is None or have is None or need <= have

    def endpoint_priority(self, model: Model, endpoint: Endpoint) -> int | None:
        """The endpoint's failover rank for the model (lower is used first; Envoy moves to the
        next rank only when the ones before are unhealthy): by zone in the model's `zones`
        order (unlisted zones after), then preferred GPU class before the others. None when
        the model does not fit its memory. EDS priorities are these ranks, renumbered 0, 1...
        over the ranks a version actually uses."""
        if not self.fits(model, endpoint):
            return None
        gpu_rank = 0 if not model.preferred_gpus or endpoint.gpu in model.preferred_gpus else 1
        zone_rank = 0
        if model.zones:
            zone_rank = model.zones.index(endpoint.zone) if endpoint.zone in model.zones else len(model.zones)
        return zone_rank * 2 + gpu_rank

    def health_of(self, model: Model, version: Version) -> HealthProbe:
        """How a version's servers are asked about readiness: the version's probe, else the
        model's, else gRPC health for a model served over HTTP/2 (gRPC), else HTTP GET of
        signals.health_path; an HTTP probe without a path gets signals.health_path."""
        probe = version.health or model.health
        if probe is None:
            probe = HealthProbe("grpc") if model.protocol == "http2" else HealthProbe("http")
        if probe.kind == "http" and probe.path is None:
            probe = replace(probe, path=self.signals.health_path)
        return probe

    def metrics_of(self, model: Model, version: Version) -> MetricsProbe:
        """Where a version's servers' metrics are read: the version's, else the model's, else
        signals.metrics_path on the serving port."""
        probe = version.metrics or model.metrics or MetricsProbe()
        if probe.path is None:
            probe = replace(probe, path=self.signals.metrics_path)
        return probe

    def declared_capacity(self, endpoint: Endpoint) -> float | None:
        """The endpoint's own capacity, else its GPU class's; None if neither is configured."""
        if endpoint.capacity is not None:
            return endpoint.capacity
        for g in self.gpu_classes:
            if g.name == endpoint.gpu:
                return g.capacity
        return None
