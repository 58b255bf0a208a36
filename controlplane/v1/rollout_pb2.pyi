from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StartRolloutRequest(_message.Message):
    __slots__ = ("model", "to_version", "steps", "interval_seconds", "manual", "max_error_rate", "max_latency_ratio", "min_requests", "ack_deadline_seconds", "shadow_percent")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MANUAL_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_RATE_FIELD_NUMBER: _ClassVar[int]
    MAX_LATENCY_RATIO_FIELD_NUMBER: _ClassVar[int]
    MIN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACK_DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_PERCENT_FIELD_NUMBER: _ClassVar[int]
    model: str
    to_version: str
    steps: _containers.RepeatedScalarFieldContainer[int]
    interval_seconds: float
    manual: bool
    max_error_rate: float
    max_latency_ratio: float
    min_requests: int
    ack_deadline_seconds: float
    shadow_percent: int
    def __init__(self, model: _Optional[str] = ..., to_version: _Optional[str] = ..., steps: _Optional[_Iterable[int]] = ..., interval_seconds: _Optional[float] = ..., manual: _Optional[bool] = ..., max_error_rate: _Optional[float] = ..., max_latency_ratio: _Optional[float] = ..., min_requests: _Optional[int] = ..., ack_deadline_seconds: _Optional[float] = ..., shadow_percent: _Optional[int] = ...) -> None: ...

class GetRolloutRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class RolloutCommand(_message.Message):
    __slots__ = ("model", "full", "reason")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model: str
    full: bool
    reason: str
    def __init__(self, model: _Optional[str] = ..., full: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ListRolloutsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRolloutsResponse(_message.Message):
    __slots__ = ("rollouts",)
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedCompositeFieldContainer[Rollout]
    def __init__(self, rollouts: _Optional[_Iterable[_Union[Rollout, _Mapping]]] = ...) -> None: ...

class VersionAnalysis(_message.Message):
    __slots__ = ("version", "requests", "error_rate", "p99_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_RATE_FIELD_NUMBER: _ClassVar[int]
    P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: str
    requests: float
    error_rate: float
    p99_seconds: float
    def __init__(self, version: _Optional[str] = ..., requests: _Optional[float] = ..., error_rate: _Optional[float] = ..., p99_seconds: _Optional[float] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("model", "stable_version", "canary_version", "phase", "step", "steps", "weights", "reason", "interval_seconds", "manual", "max_error_rate", "max_latency_ratio", "min_requests", "step_started_at", "canary", "stable", "ack_deadline_seconds", "shadow_percent", "finishing")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANARY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MANUAL_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_RATE_FIELD_NUMBER: _ClassVar[int]
    MAX_LATENCY_RATIO_FIELD_NUMBER: _ClassVar[int]
    MIN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEP_STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    STABLE_FIELD_NUMBER: _ClassVar[int]
    ACK_DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_PERCENT_FIELD_NUMBER: _ClassVar[int]
    FINISHING_FIELD_NUMBER: _ClassVar[int]
    model: str
    stable_version: str
    canary_version: str
    phase: str
    step: int
    steps: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.ScalarMap[str, int]
    reason: str
    interval_seconds: float
    manual: bool
    max_error_rate: float
    max_latency_ratio: float
    min_requests: int
    step_started_at: float
    canary: VersionAnalysis
    stable: VersionAnalysis
    ack_deadline_seconds: float
    shadow_percent: int
    finishing: bool
    def __init__(self, model: _Optional[str] = ..., stable_version: _Optional[str] = ..., canary_version: _Optional[str] = ..., phase: _Optional[str] = ..., step: _Optional[int] = ..., steps: _Optional[_Iterable[int]] = ..., weights: _Optional[_Mapping[str, int]] = ..., reason: _Optional[str] = ..., interval_seconds: _Optional[float] = ..., manual: _Optional[bool] = ..., max_error_rate: _Optional[float] = ..., max_latency_ratio: _Optional[float] = ..., min_requests: _Optional[int] = ..., step_started_at: _Optional[float] = ..., canary: _Optional[_Union[VersionAnalysis, _Mapping]] = ..., stable: _Optional[_Union[VersionAnalysis, _Mapping]] = ..., ack_deadline_seconds: _Optional[float] = ..., shadow_percent: _Optional[int] = ..., finishing: _Optional[bool] = ...) -> None: ...

class AuditRecord(_message.Message):
    __slots__ = ("model", "at", "who", "phase", "step", "weight", "reason")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    WHO_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model: str
    at: float
    who: str
    phase: str
    step: int
    weight: int
    reason: str
    def __init__(self, model: _Optional[str] = ..., at: _Optional[float] = ..., who: _Optional[str] = ..., phase: _Optional[str] = ..., step: _Optional[int] = ..., weight: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class HistoryResponse(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[AuditRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[AuditRecord, _Mapping]]] = ...) -> None: ...
