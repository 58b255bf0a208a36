from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QuotaStatusRequest(_message.Message):
    __slots__ = ("tenant", "page_size", "page_token")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    page_size: int
    page_token: str
    def __init__(self, tenant: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class QuotaBucket(_message.Message):
    __slots__ = ("tenant", "model", "kind", "limit_per_minute", "remaining", "reset_seconds")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LIMIT_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    RESET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    kind: str
    limit_per_minute: int
    remaining: int
    reset_seconds: float
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ..., kind: _Optional[str] = ..., limit_per_minute: _Optional[int] = ..., remaining: _Optional[int] = ..., reset_seconds: _Optional[float] = ...) -> None: ...

class QuotaStatusResponse(_message.Message):
    __slots__ = ("buckets", "next_page_token")
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedCompositeFieldContainer[QuotaBucket]
    next_page_token: str
    def __init__(self, buckets: _Optional[_Iterable[_Union[QuotaBucket, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...
