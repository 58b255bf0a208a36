"""A small tokenizer for emulated fleets (no download): a byte-level BPE of 512 tokens trained
here on a few lines, saved as a Hugging Face tokenizer directory (tokenizer.json,
tokenizer_config.json with a plain chat template), the shape a model's `tokenizer:` names.
Byte-level: any text tokenizes, and different texts give different ids. The emulator
(`EmulatorConfig.tokenizer`) and the picker read the same directory, as a vLLM and the picker
read a real model's."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer the question below in a few words.",
    "A control plane weighs the servers of a model by their load and their cache.",
    "system user assistant: request queue running waiting tokens cache prefix block",
] * 20


def make_tokenizer(directory: Path, words: Iterable[str] | None = None) -> Path:
    """Write the tokenizer into `directory` (made if missing); returns it. With `words`, a
    word-level tokenizer of those words instead (one token per whitespace-separated word, as
    the emulator counts a prompt without a tokenizer; any other word is <unk>): benchmarks whose
    prompts are drawn from a known vocabulary keep their token counts."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    directory.mkdir(parents=True, exist_ok=True)
    if words is not None:
        vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
        for w in words:
            vocab.setdefault(w, len(vocab))
        tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = WhitespaceSplit()
        tok.save(str(directory / "tokenizer.json"))
    else:
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(
            _TEXT, vocab_size=512, min_frequency=1, special_tokens=["<s>", "</s>", "<unk>"]
        )
        bpe.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory
