from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListProxiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerVersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    def __init__(self, version: _Optional[str] = ...) -> None: ...

class TypeStatus(_message.Message):
    __slots__ = ("type", "status", "acked_version", "last_nack", "resources", "reason")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ACKED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_NACK_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    type: str
    status: str
    acked_version: str
    last_nack: str
    resources: int
    reason: str
    def __init__(self, type: _Optional[str] = ..., status: _Optional[str] = ..., acked_version: _Optional[str] = ..., last_nack: _Optional[str] = ..., resources: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Proxy(_message.Message):
    __slots__ = ("node_id", "node_cluster", "address", "user_agent", "service", "transport", "connected_seconds", "types", "version", "notes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    USER_AGENT_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TYPES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_cluster: str
    address: str
    user_agent: str
    service: str
    transport: str
    connected_seconds: float
    types: _containers.RepeatedCompositeFieldContainer[TypeStatus]
    version: str
    notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., node_cluster: _Optional[str] = ..., address: _Optional[str] = ..., user_agent: _Optional[str] = ..., service: _Optional[str] = ..., transport: _Optional[str] = ..., connected_seconds: _Optional[float] = ..., types: _Optional[_Iterable[_Union[TypeStatus, _Mapping]]] = ..., version: _Optional[str] = ..., notes: _Optional[_Iterable[str]] = ...) -> None: ...

class ListProxiesResponse(_message.Message):
    __slots__ = ("proxies",)
    PROXIES_FIELD_NUMBER: _ClassVar[int]
    proxies: _containers.RepeatedCompositeFieldContainer[Proxy]
    def __init__(self, proxies: _Optional[_Iterable[_Union[Proxy, _Mapping]]] = ...) -> None: ...
