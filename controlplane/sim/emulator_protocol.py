"""The emulator's HTTP contract, pure (no I/O): request validation, response bodies, faults.

Requests follow the OpenAI completions and chat-completions API. A token is a
whitespace-separated word: a prompt of "why is the sky blue" is 5 prompt tokens, and
chat messages count the words of their text contents (no chat-template overhead). Every
refusal is an `ApiError` that renders as OpenAI's error JSON, naming the field at fault.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

RequestKind = Literal["completion", "chat"]

# The emulated model's output: token k of any answer is _VOCABULARY[k % len].
_VOCABULARY = (
    "the",
    "emulated",
    "model",
    "answers",
    "one",
    "word",
    "per",
    "token",
    "at",
    "its",
    "decode",
    "rate",
)

MAX_BACKLOG = 10_000
MAX_FAILING_ADAPTERS = 4096  # names in the lora_load_fail fault


class ApiError(Exception):
    """A request refused with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,  # OpenAI's are strings; vLLM's own endpoints use the status
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _invalid(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completion or chat-completion request."""

    kind: RequestKind
    model: str
    prompt_tokens: int
    output_tokens: int
    max_tokens_given: bool  # the client set the length: the answer stops at it ("length")
    stream: bool
    include_usage: bool
    prompt: tuple[str, ...] = ()  # the prompt's tokens (the emulator's tokenizer), for the prefix cache
    adapter: str | None = None  # the LoRA adapter `model` names (None: the base model)

    @property
    def finish_reason(self) -> str:
        return "length" if self.max_tokens_given else "stop"


def tokens_of(text: str) -> list[str]:
    """The emulator's tokenizer: one token per whitespace-separated word."""
    return text.split()


def parse_completion_request(
    raw: bytes,
    kind: RequestKind,
    *,
    served_model: str,
    default_max_tokens: int,
    max_tokens_limit: int,
    adapters: Collection[str] = (),
) -> CompletionRequest:
    """Validate a request body; raise ApiError (400, or 404 for another model). A `model` that
    is one of `adapters` (the LoRA adapters registered) is served by that adapter, as vLLM does."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _invalid(None, f"request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise _invalid(None, f"request body must be a JSON object, got {_kind_of(body)}", "invalid_type")
    model = body.get("model")
    if model is None:
        raise _invalid("model", "missing required field 'model'", "missing_required_parameter")
    if not isinstance(model, str):
        raise _invalid("model", f"'model' must be a string, got {_kind_of(model)}", "invalid_type")
    if model != served_model and model not in adapters:
        also = f" and {len(adapters)} LoRA adapters (GET /v1/models lists them)" if adapters else ""
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{served_model}'{also}",
            param="model",
            code="model_not_found",
        )
    prompt = _chat_tokens(body) if kind == "chat" else _prompt_tokens(body)
    prompt_tokens = len(prompt)
    output_tokens, given = _max_tokens(body, default_max_tokens, max_tokens_limit)
    stream = _optional_bool(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _invalid(
                "stream_options",
                f"'stream_options' must be an object, got {_kind_of(options)}",
                "invalid_type",
            )
        include_usage = _optional_bool(options, "include_usage", "stream_options.include_usage")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise _invalid("n", f"'n' must be 1 (the emulator generates one choice), got {n!r}")
    adapter = model if model != served_model else None
    return CompletionRequest(
        kind, model, prompt_tokens, output_tokens, given, stream, include_usage, tuple(prompt), adapter
    )


def _prompt_tokens(body: dict[str, Any]) -> list[str]:
    prompt = body.get("prompt")
    if prompt is None:
        raise _invalid("prompt", "missing required field 'prompt'", "missing_required_parameter")
    if isinstance(prompt, str):
        return tokens_of(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [str(t) for t in prompt]  # token ids
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return tokens_of(prompt[0])
        if all(isinstance(t, str) for t in prompt):
            raise _invalid("prompt", f"'prompt' must be one prompt, got a batch of {len(prompt)}")
    raise _invalid(
        "prompt",
        f"'prompt' must be a string, a list of one string or a list of token ids, got {_kind_of(prompt)}",
        "invalid_type",
    )


def _chat_tokens(body: dict[str, Any]) -> list[str]:
    messages = body.get("messages")
    if messages is None:
        raise _invalid("messages", "missing required field 'messages'", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "'messages' must be a non-empty list of message objects", "invalid_type")
    tokens: list[str] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _invalid(where, f"'{where}' must be an object, got {_kind_of(message)}", "invalid_type")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _invalid(f"{where}.role", f"'{where}.role' must be a non-empty string", "invalid_type")
        content = message.get("content")
        if content is None or isinstance(content, str):
            tokens += tokens_of(content or "")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _invalid(
                        f"{where}.content[{j}]",
                        f"'{where}.content[{j}]' must be an object with a string 'type'",
                        "invalid_type",
                    )
                if part["type"] == "text":
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise _invalid(
                            f"{where}.content[{j}].text",
                            f"'{where}.content[{j}].text' must be a string",
                            "invalid_type",
                        )
                    tokens += tokens_of(text)
        else:
            raise _invalid(
                f"{where}.content",
                f"'{where}.content' must be a string, a list of parts or null, got {_kind_of(content)}",
                "invalid_type",
            )
    return tokens


def _max_tokens(body: dict[str, Any], default: int, limit: int) -> tuple[int, bool]:
    # max_completion_tokens is OpenAI's newer name; it wins when both are sent.
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise _invalid(name, f"'{name}' must be an integer, got {_kind_of(value)}", "invalid_type")
        if not 1 <= value <= limit:
            raise _invalid(name, f"'{name}' must be between 1 and {limit}, got {value}")
        return value, True
    return default, False


def _optional_bool(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _invalid(
            param or name, f"'{param or name}' must be true or false, got {_kind_of(value)}", "invalid_type"
        )
    return value


def _kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


# --- responses -------------------------------------------------------------------------


def output_token(k: int) -> str:
    """Token k (0-based) of an answer, with the space that separates it from token k-1."""
    word = _VOCABULARY[k % len(_VOCABULARY)]
    return word if k == 0 else f" {word}"


def output_text(n: int) -> str:
    return "".join(output_token(k) for k in range(n))


def usage(req: CompletionRequest) -> dict[str, int]:
    return {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": req.output_tokens,
        "total_tokens": req.prompt_tokens + req.output_tokens,
    }


def completion_body(req: CompletionRequest, request_id: str, created: int) -> dict[str, Any]:
    """The non-streaming answer."""
    text = output_text(req.output_tokens)
    if req.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": req.finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": req.finish_reason}
        obj = "text_completion"
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": [choice],
        "usage": usage(req),
    }


def stream_chunk(
    req: CompletionRequest, request_id: str, created: int, k: int | None, *, with_usage: bool = False
) -> dict[str, Any]:
    """One SSE chunk: token k (0-based); k=None is the closing chunk with the finish reason,
    and with_usage the usage-only chunk that `stream_options.include_usage` asks for."""
    choices: list[dict[str, Any]] = []
    if not with_usage:
        finish = req.finish_reason if k is None else None
        text = "" if k is None else output_token(k)
        if req.kind == "chat":
            delta: dict[str, Any] = {} if k is None else {"content": text}
            if k == 0:
                delta["role"] = "assistant"
            choices.append({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish})
        else:
            choices.append({"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
        "created": created,
        "model": req.model,
        "choices": choices,
    }
    if with_usage:
        chunk["usage"] = usage(req)
    return chunk


def sse(payload: Mapping[str, Any] | str) -> bytes:
    """An SSE event: `data: <json>` (or a literal such as [DONE]) and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


# --- faults ----------------------------------------------------------------------------


class FaultsInvalid(ValueError):
    """A fault setting that is not allowed; `field` names it."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Faults:
    """Conditions injected into an emulated server (all off by default)."""

    slow: float = 1.0  # multiplier on service time of sequences that start from now on
    error_rate: float = 0.0  # fraction of requests answered 500
    oom_rate: float = 0.0  # fraction of requests answered 507 (out of memory)
    crash: bool = False  # the process is gone: connection refused
    backlog: int = 0  # phantom long requests kept in the server's queue and slots
    garbage_metrics: bool = False  # /metrics answers a page that is not Prometheus text
    # GET /health and /metrics never answer (the client times out) while serving works: the
    # control plane's path to the server is blackholed, the proxies' is not.
    probes_hang: bool = False
    metrics_port_down: bool = False  # the separate metrics port (--metrics-port) refuses connections
    # LoRA adapters whose load into a GPU slot fails: registering one (POST /v1/load_lora_adapter)
    # is refused, a request that needs it loaded is answered 500.
    lora_load_fail: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, kind in _FAULT_TYPES.items():
            _check_type(name, getattr(self, name), kind)
            if kind is float:
                object.__setattr__(self, name, float(getattr(self, name)))  # 2 -> 2.0, as JSON shows it
            elif kind is tuple:
                object.__setattr__(self, name, tuple(getattr(self, name)))  # a JSON list, frozen
        if not (math.isfinite(self.slow) and self.slow > 0):
            raise FaultsInvalid("slow", f"'slow' must be a finite number > 0, got {self.slow!r}")
        for name in ("error_rate", "oom_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise FaultsInvalid(name, f"'{name}' must be between 0 and 1, got {value!r}")
        if self.error_rate + self.oom_rate > 1.0:
            raise FaultsInvalid(
                "oom_rate",
                f"'error_rate' + 'oom_rate' must be at most 1, got {self.error_rate} + {self.oom_rate}",
            )
        if not 0 <= self.backlog <= MAX_BACKLOG:
            raise FaultsInvalid(
                "backlog", f"'backlog' must be between 0 and {MAX_BACKLOG}, got {self.backlog}"
            )
        if len(self.lora_load_fail) > MAX_FAILING_ADAPTERS:
            raise FaultsInvalid(
                "lora_load_fail",
                f"'lora_load_fail' must name at most {MAX_FAILING_ADAPTERS} adapters, "
                f"got {len(self.lora_load_fail)}",
            )

    def updated(self, changes: object) -> Faults:
        """These faults with `changes` (a JSON object of fields) applied; unnamed fields keep
        their values. Raise FaultsInvalid naming the first bad field."""
        if not isinstance(changes, dict):
            raise FaultsInvalid(None, f"faults must be a JSON object, got {_kind_of(changes)}")
        for name in changes:
            if name not in _FAULT_TYPES:
                raise FaultsInvalid(
                    str(name), f"unknown fault {name!r}; known: {', '.join(sorted(_FAULT_TYPES))}"
                )
        for name, value in changes.items():
            _check_type(name, value, _FAULT_TYPES[name])
        return Faults(**{**asdict(self), **changes})

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "lora_load_fail": list(self.lora_load_fail)}  # as JSON reads back


_FAULT_TYPES: dict[str, type] = {
    f.name: {"float": float, "int": int, "bool": bool, "tuple[str, ...]": tuple}[str(f.type)]
    for f in fields(Faults)
}


def _check_type(name: str, value: object, kind: type) -> None:
    if kind is tuple:
        ok = isinstance(value, list | tuple)
        for item in value if isinstance(value, list | tuple) else ():
            if not isinstance(item, str) or not item:
                raise FaultsInvalid(
                    name, f"'{name}' must be a list of non-empty adapter names, got {item!r} in it"
                )
    elif kind is bool:
        ok = isinstance(value, bool)
    else:
        ok = not isinstance(value, bool) and isinstance(value, int | float if kind is float else int)
    if not ok:
        expected = {
            bool: "true or false",
            int: "an integer",
            float: "a number",
            tuple: "a list of non-empty adapter names",
        }[kind]
        raise FaultsInvalid(name, f"'{name}' must be {expected}, got {_kind_of(value)}")
