"""A tiny random-weight Llama and its tokenizer for a real vLLM server (issue 32), no download.

Runs with the Python of the separate venv that has vLLM's CPU build (torch, transformers and
tokenizers come with it), never the project's, so it imports nothing from the project:

    /tmp/vllm-venv/bin/python tests/real/vllm_model.py OUTDIR

writes the model into OUTDIR and prints a one-line description of it. The tests in
tests/real/test_vllm.py and scripts/capture_vllm_pages.py both run it so.

`LlamaConfig` hidden 256, 4 heads of 64 (vLLM's CPU attention refuses a head dim of 16),
2 layers, bfloat16, saved with `save_pretrained`; a byte-level BPE tokenizer trained with
`tokenizers` on a few lines of text, with a plain chat template ("role: content" lines, then
"assistant:") so that chat completions work too. Seeded: the same weights every time.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_model(path: Path) -> str:
    """A random-weight Llama and its tokenizer in `path`; returns a one-line description."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    text = [
        "The quick brown fox jumps over the lazy dog.",
        "A control plane weighs the servers of a model by their load.",
        "Hello, world! request queue running waiting tokens cache",
    ] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(text, vocab_size=512, min_frequency=1, special_tokens=["<s>", "</s>", "<unk>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    # Without one, vLLM answers every chat completion 400 (transformers has no default since 4.44).
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,  # head dim 64: vLLM's CPU attention refuses 16
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return (
        f"random-weight LlamaForCausalLM (transformers {version('transformers')}): hidden 256, "
        f"4 heads of 64, 2 layers, bfloat16; byte-level BPE tokenizer of {len(tok)} tokens "
        f"(tokenizers {version('tokenizers')}) with a plain chat template, made locally, no download"
    )


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUTDIR")
    print(make_model(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
