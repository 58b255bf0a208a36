from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReportQueuedRequest(_message.Message):
    __slots__ = ("picker", "queued")
    class QueuedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PICKER_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    picker: str
    queued: _containers.ScalarMap[str, int]
    def __init__(self, picker: _Optional[str] = ..., queued: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ReportQueuedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEndpointsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("address", "timeout_seconds", "reason")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    address: str
    timeout_seconds: float
    reason: str
    def __init__(self, address: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("model", "version", "address", "gpu", "state", "weight", "capacity", "running", "waiting", "in_flight", "kv_use", "latency_seconds", "error_rate", "signal_age_seconds", "drain_started_at", "sight", "note", "source", "last_seen_seconds", "scrape_error", "scrape_error_reason", "prefill_seconds_per_token", "decode_seconds_per_request", "running_adapters", "waiting_adapters", "max_adapters")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_USE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_RATE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    SIGHT_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCRAPE_ERROR_FIELD_NUMBER: _ClassVar[int]
    SCRAPE_ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    RUNNING_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    address: str
    gpu: str
    state: str
    weight: int
    capacity: float
    running: float
    waiting: float
    in_flight: float
    kv_use: float
    latency_seconds: float
    error_rate: float
    signal_age_seconds: float
    drain_started_at: float
    sight: str
    note: str
    source: str
    last_seen_seconds: float
    scrape_error: str
    scrape_error_reason: str
    prefill_seconds_per_token: float
    decode_seconds_per_request: float
    running_adapters: _containers.RepeatedScalarFieldContainer[str]
    waiting_adapters: _containers.RepeatedScalarFieldContainer[str]
    max_adapters: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., address: _Optional[str] = ..., gpu: _Optional[str] = ..., state: _Optional[str] = ..., weight: _Optional[int] = ..., capacity: _Optional[float] = ..., running: _Optional[float] = ..., waiting: _Optional[float] = ..., in_flight: _Optional[float] = ..., kv_use: _Optional[float] = ..., latency_seconds: _Optional[float] = ..., error_rate: _Optional[float] = ..., signal_age_seconds: _Optional[float] = ..., drain_started_at: _Optional[float] = ..., sight: _Optional[str] = ..., note: _Optional[str] = ..., source: _Optional[str] = ..., last_seen_seconds: _Optional[float] = ..., scrape_error: _Optional[str] = ..., scrape_error_reason: _Optional[str] = ..., prefill_seconds_per_token: _Optional[float] = ..., decode_seconds_per_request: _Optional[float] = ..., running_adapters: _Optional[_Iterable[str]] = ..., waiting_adapters: _Optional[_Iterable[str]] = ..., max_adapters: _Optional[int] = ...) -> None: ...

class ListEndpointsResponse(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    def __init__(self, endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ...) -> None: ...
