from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InFlightRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInFlight(_message.Message):
    __slots__ = ("address", "requests")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    address: str
    requests: int
    def __init__(self, address: _Optional[str] = ..., requests: _Optional[int] = ...) -> None: ...

class InFlightResponse(_message.Message):
    __slots__ = ("servers",)
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[ServerInFlight]
    def __init__(self, servers: _Optional[_Iterable[_Union[ServerInFlight, _Mapping]]] = ...) -> None: ...
