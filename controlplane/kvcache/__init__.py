"""What each server's KV cache holds: vLLM's KV events read (wire.py), a prompt's blocks
keyed as the events' blocks are (blocks.py), the precise index of who holds what (index.py),
and the tokenizer that sees a prompt as the server does (prompt.py). Pure but for
prompt.py's reading of tokenizer files; the picker subscribes (picker/kv_events.py)."""
