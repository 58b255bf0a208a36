"""The prefix-affinity key script (controlplane/routing/prefix_key.lua) run in LuaJIT 2.1,
the Lua of Envoy's Lua filter (through lupa), with a stand-in for Envoy's request handle
that has the three calls the script makes: body(), metadata(), streamInfo()."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lupa.luajit21 as luajit
from hypothesis import given, settings
from hypothesis import strategies as st

SCRIPT = (Path(__file__).resolve().parents[2] / "controlplane" / "routing" / "prefix_key.lua").read_text()
DEFAULTS = {"prefix_messages": 1, "prefix_prompt_bytes": 1024, "prefix_max_bytes": 16384}

LUA = luajit.LuaRuntime()
LUA.execute(SCRIPT)
ON_REQUEST = LUA.globals().envoy_on_request
HANDLE = LUA.eval(
    """function(body, settings, out)
      local b = body and {
        length = function(self) return #body end,
        getBytes = function(self, i, n) return string.sub(body, i + 1, i + n) end,
      } or nil
      local md = { get = function(self, k) return settings and settings[k] or nil end }
      local dyn = { set = function(self, ns, k, v) out[ns .. "." .. k] = v end }
      local si = { dynamicMetadata = function(self) return dyn end }
      return {
        body = function(self) return b end,
        metadata = function(self) return md end,
        streamInfo = function(self) return si end,
      }
    end"""
)


def key_of(body: str | None, settings: dict[str, int] | None = None) -> str | None:
    out = LUA.table()
    lua_settings = LUA.table_from(settings if settings is not None else DEFAULTS)
    ON_REQUEST(HANDLE(body, lua_settings if settings != {} else None, out))
    got: Any = out["controlplane.affinity_prefix"]
    return got


def chat(*messages: Any, **extra: Any) -> str:
    return json.dumps({"model": "m", "messages": list(messages), **extra})


SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 20}


def test_chat_key_is_the_first_message_whatever_follows() -> None:
    a = key_of(chat(SYSTEM, {"role": "user", "content": "hi"}))
    b = key_of(chat(SYSTEM, {"role": "user", "content": "something else entirely"}, max_tokens=9))
    assert a == b == json.dumps(SYSTEM)
    other = dict(SYSTEM, content="Another system prompt.")
    assert key_of(chat(other, {"role": "user", "content": "hi"})) != a


def test_two_messages_keep_a_conversation_together() -> None:
    two = {**DEFAULTS, "prefix_messages": 2}
    first = {"role": "user", "content": "plan a trip"}
    a = key_of(chat(SYSTEM, first, {"role": "assistant", "content": "sure"}), two)
    b = key_of(
        chat(SYSTEM, first, {"role": "assistant", "content": "sure"}, {"role": "user", "content": "more"}),
        two,
    )
    assert a == b == json.dumps(SYSTEM) + ", " + json.dumps(first)


def test_strings_with_brackets_quotes_and_escapes_do_not_confuse_the_scan() -> None:
    tricky = {"role": "system", "content": 'a } ] { [ "quoted" \\ back\\slash \u00e9 {"json": [1]}'}
    assert key_of(chat(tricky, {"role": "user", "content": "x"})) == json.dumps(tricky)


def test_content_parts_are_part_of_the_message() -> None:
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}],
    }
    assert key_of(chat(parts, {"role": "user", "content": "x"})) == json.dumps(parts)


def test_a_long_system_prompt_is_cut_at_max_bytes() -> None:
    small = {**DEFAULTS, "prefix_max_bytes": 100}
    body = chat({"role": "system", "content": "x" * 1000})
    key = key_of(body, small)
    assert key is not None and len(key) == 100 and body[body.index("[") + 1 :].startswith(key)


def test_fewer_messages_than_asked_is_the_whole_array() -> None:
    three = {**DEFAULTS, "prefix_messages": 3}
    assert key_of(chat(SYSTEM), three) == json.dumps(SYSTEM)


def test_completions_key_is_the_prompts_first_bytes() -> None:
    small = {**DEFAULTS, "prefix_prompt_bytes": 20}
    body = json.dumps(
        {"model": "m", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 3}
    )
    assert key_of(body, small) == '"The quick brown fox'
    ids = json.dumps({"model": "m", "prompt": [1, 2, 3]})
    assert key_of(ids) == "[1, 2, 3]}"


def test_no_key_without_settings_a_body_or_a_prompt() -> None:
    assert key_of(chat(SYSTEM), {}) is None  # a model without prefix affinity
    assert key_of(None) is None
    assert key_of("") is None
    assert key_of(json.dumps({"model": "m", "input": "embeddings"})) is None
    assert key_of('{"messages": []}') is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=60)}
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 3),
    st.booleans(),
)
def test_the_key_is_the_first_messages_as_sent(
    messages: list[dict[str, str]], n: int, ascii_only: bool
) -> None:
    body = json.dumps({"model": "m", "messages": messages}, ensure_ascii=ascii_only)
    got = key_of(body, {**DEFAULTS, "prefix_messages": n})
    assert got == ", ".join(json.dumps(m, ensure_ascii=ascii_only) for m in messages[:n])


def metadata_of(body: str | None, settings: dict[str, int]) -> dict[str, Any]:
    out = LUA.table()
    ON_REQUEST(HANDLE(body, LUA.table_from(settings), out))
    return dict(out.items())


def test_a_model_with_a_tokenizer_hands_the_picker_its_whole_body_up_to_the_bound() -> None:
    body = chat(SYSTEM, {"role": "user", "content": "hi"})
    got = metadata_of(body, {"prompt_max_bytes": 1 << 20})
    assert got == {"controlplane.prompt": body}  # no prefix affinity: no key
    both = metadata_of(body, {**DEFAULTS, "prompt_max_bytes": 1 << 20})
    assert both == {"controlplane.prompt": body, "controlplane.affinity_prefix": json.dumps(SYSTEM)}
    # A body over the bound is not handed over (a cut one would not parse): the key still is.
    over = metadata_of(body, {**DEFAULTS, "prompt_max_bytes": len(body) - 1})
    assert over == {"controlplane.affinity_prefix": json.dumps(SYSTEM)}
    assert metadata_of(None, {"prompt_max_bytes": 1 << 20}) == {}
