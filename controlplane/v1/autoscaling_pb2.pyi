from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListAutoscalingRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ModelScaling(_message.Message):
    __slots__ = ("model", "version", "desired", "ready", "demand", "stable_demand", "panic_demand", "target_per_replica", "panicking", "active", "reason", "idle_seconds", "predicted_demand", "forecast_method", "lead_seconds", "min", "max", "remove", "draining")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DEMAND_FIELD_NUMBER: _ClassVar[int]
    STABLE_DEMAND_FIELD_NUMBER: _ClassVar[int]
    PANIC_DEMAND_FIELD_NUMBER: _ClassVar[int]
    TARGET_PER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    PANICKING_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_DEMAND_FIELD_NUMBER: _ClassVar[int]
    FORECAST_METHOD_FIELD_NUMBER: _ClassVar[int]
    LEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    desired: int
    ready: int
    demand: float
    stable_demand: float
    panic_demand: float
    target_per_replica: float
    panicking: bool
    active: bool
    reason: str
    idle_seconds: float
    predicted_demand: float
    forecast_method: str
    lead_seconds: float
    min: int
    max: int
    remove: _containers.RepeatedScalarFieldContainer[str]
    draining: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., desired: _Optional[int] = ..., ready: _Optional[int] = ..., demand: _Optional[float] = ..., stable_demand: _Optional[float] = ..., panic_demand: _Optional[float] = ..., target_per_replica: _Optional[float] = ..., panicking: _Optional[bool] = ..., active: _Optional[bool] = ..., reason: _Optional[str] = ..., idle_seconds: _Optional[float] = ..., predicted_demand: _Optional[float] = ..., forecast_method: _Optional[str] = ..., lead_seconds: _Optional[float] = ..., min: _Optional[int] = ..., max: _Optional[int] = ..., remove: _Optional[_Iterable[str]] = ..., draining: _Optional[_Iterable[str]] = ...) -> None: ...

class ListAutoscalingResponse(_message.Message):
    __slots__ = ("scaling",)
    SCALING_FIELD_NUMBER: _ClassVar[int]
    scaling: _containers.RepeatedCompositeFieldContainer[ModelScaling]
    def __init__(self, scaling: _Optional[_Iterable[_Union[ModelScaling, _Mapping]]] = ...) -> None: ...
