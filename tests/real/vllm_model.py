"""A tiny random-weight Llama and its tokenizer for a real vLLM server (issue 32), no download.

Runs with the Python of the separate venv that has vLLM's CPU build (torch, transformers and
tokenizers come with it), never the project's, so it imports nothing from the project:

    /tmp/vllm-venv/bin/python tests/real/vllm_model.py OUTDIR
    /tmp/vllm-venv/bin/python tests/real/vllm_model.py --lora MODELDIR OUTDIR [--seed N]

The first writes the model into OUTDIR, the second a LoRA adapter for the model in MODELDIR
(issue 45); each prints a one-line description of what it wrote. The tests in
tests/real/test_vllm.py and scripts/capture_vllm_pages.py run the first, tests/real/
test_vllm_lora.py both.

`LlamaConfig` hidden 256, 4 heads of 64 (vLLM's CPU attention refuses a head dim of 16),
2 layers, bfloat16, saved with `save_pretrained`; a byte-level BPE tokenizer trained with
`tokenizers` on a few lines of text, with a plain chat template ("role: content" lines, then
"assistant:") so that chat completions work too. Seeded: the same weights every time.

The adapter is PEFT's format, as vLLM's loader reads it (vllm/lora/peft_helper.py and
lora_model.py): adapter_config.json (r, lora_alpha, target_modules; no DoRA, no bias) and
adapter_model.safetensors with `base_model.model.model.layers.{i}.self_attn.{q,v}_proj.
lora_{A,B}.weight`, A of r x in, B of out x r. B random too (PEFT starts it at zeros, which
would leave the base model's answers), so that an adapter changes them; a seed per adapter, so
two adapters differ and each is the same every time. Rank 8: within --max-lora-rank (16 by
default; tests/real/test_vllm_lora.py gives 8).
"""

from __future__ import annotations

import argparse
import json
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


LORA_RANK = 8
LORA_TARGETS = ("q_proj", "v_proj")


def make_lora(model: Path, path: Path, seed: int = 1) -> str:
    """A random-weight rank-8 LoRA adapter on `model`'s q_proj and v_proj (its shapes from
    the model's config.json) in `path`; returns a one-line description."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj in LORA_TARGETS:
            name = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(LORA_RANK, hidden, generator=gen) / hidden**0.5
            tensors[f"{name}.lora_B.weight"] = (
                torch.randn(out[proj], LORA_RANK, generator=gen) / LORA_RANK**0.5
            )
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, path / "adapter_model.safetensors"
    )
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model),
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter, indent=2) + "\n")
    return (
        f"random-weight LoRA adapter (seed {seed}): rank {LORA_RANK}, alpha {2 * LORA_RANK}, on "
        f"{' and '.join(LORA_TARGETS)} of {layers} layers, bfloat16, in PEFT's format, for {model}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="A tiny random-weight Llama, or a LoRA adapter for it.")
    parser.add_argument("--lora", metavar="MODELDIR", type=Path, help="write a LoRA adapter for this model")
    parser.add_argument("--seed", type=int, default=1, help="the adapter's seed (default 1)")
    parser.add_argument("outdir", type=Path)
    args = parser.parse_args()
    if args.lora is not None:
        print(make_lora(args.lora, args.outdir, args.seed))
    else:
        print(make_model(args.outdir))


if __name__ == "__main__":
    main()
