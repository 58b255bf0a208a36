"""The prompt as the server sees it: its token ids, from the request body, with the model's
own tokenizer and chat template (the `tokenizer:` directory of a model in the fleet file: a
Hugging Face tokenizer's `tokenizer.json`, `tokenizer_config.json`, and the chat template in
the latter's `chat_template` or in `chat_template.jinja`).

As vLLM's OpenAI server does:
- a chat completion's `messages` are rendered with the template of `tokenizer_config.json`
  (`chat_template`, with `add_generation_prompt`, `bos_token` and `eos_token`), in a
  sandboxed Jinja2 environment with `trim_blocks` and `lstrip_blocks` (as transformers
  renders it), then tokenized without special tokens added (the template writes them);
- a completion's `prompt` string is tokenized with them; a prompt of token ids is taken as is.

Anything else (no tokenizer, a body that is not such a request, a template that fails) gives
None: the request is matched by the approximate index instead. Reading the files is the only
I/O, once per directory (Tokenizers caches them).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

TOKENIZERS_KEPT = 16  # directories whose tokenizer stays loaded (the least recently used goes)
# The picker tokenizes at most this much of a rendered prompt (about 16k tokens: a few ms on
# a real model's tokenizer; the prompt's blocks past it are not matched), and drops the last
# CUT_TOKENS of a cut one (a word cut in two tokenizes otherwise than whole).
TOKENIZE_MAX_CHARS = 16 << 10
CUT_TOKENS = 16


class PromptError(ValueError):
    pass


class Tokenizer:
    """One model's tokenizer and chat template."""

    def __init__(self, directory: Path, max_chars: int | None = TOKENIZE_MAX_CHARS) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer as HfTokenizer

        path = directory / "tokenizer.json"
        if not path.is_file():
            raise PromptError(f"{path}: no such file (a tokenizer: directory holds tokenizer.json)")
        self.tokenizer = HfTokenizer.from_file(str(path))
        self.max_chars = max_chars if max_chars is not None else 1 << 62
        config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            loaded = json.loads(config_path.read_text())
            config = loaded if isinstance(loaded, dict) else {}
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        template = config.get("chat_template")
        jinja = directory / "chat_template.jinja"  # where transformers 4.43 and later save it
        if template is None and jinja.is_file():
            template = jinja.read_text()
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.template = None
        if isinstance(template, str):
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)
            self.template = env.from_string(template)

    def chat_ids(self, messages: list[Any]) -> list[int] | None:
        if self.template is None:
            return None
        text = self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        return self._ids(text, special=False)

    def prompt_ids(self, prompt: str) -> list[int]:
        return self._ids(prompt, special=True)

    def _ids(self, text: str, *, special: bool) -> list[int]:
        cut = len(text) > self.max_chars
        ids = list(
            self.tokenizer.encode(text[: self.max_chars] if cut else text, add_special_tokens=special).ids
        )
        return ids[:-CUT_TOKENS] if cut else ids


def _token_text(x: Any) -> str:
    if isinstance(x, dict):
        x = x.get("content")
    return x if isinstance(x, str) else ""


def _raise(message: str) -> None:
    raise PromptError(message)


class Tokenizers:
    """Tokenizers by directory, loaded on first use, the TOKENIZERS_KEPT most recent kept."""

    def __init__(self, max_chars: int | None = TOKENIZE_MAX_CHARS) -> None:
        self.max_chars = max_chars  # None: whole prompts (the emulator, as a server tokenizes)
        self._loaded: OrderedDict[str, Tokenizer | PromptError] = OrderedDict()

    def get(self, directory: str) -> Tokenizer:
        got = self._loaded.get(directory)
        if got is None:
            try:
                got = Tokenizer(Path(directory), self.max_chars)
            except PromptError as e:
                got = e
            except Exception as e:  # a file that is not a tokenizer: said once, not per request
                got = PromptError(f"{directory}: {type(e).__name__}: {e}")
            self._loaded[directory] = got
            while len(self._loaded) > TOKENIZERS_KEPT:
                self._loaded.popitem(last=False)
        self._loaded.move_to_end(directory)
        if isinstance(got, PromptError):
            raise got
        return got


def token_ids(tokenizer: Tokenizer, body: bytes) -> list[int] | None:
    """The request body's prompt as token ids, or None if it has none this can read."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict):
        return None
    messages = request.get("messages")
    try:
        if isinstance(messages, list) and messages:
            return tokenizer.chat_ids(messages)
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenizer.prompt_ids(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [t for t in prompt if 0 <= t < 1 << 32]
    except Exception:  # a template that fails on these messages: no ids, the approximate index
        return None
    return None
