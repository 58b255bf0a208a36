"""Flow control: the gateway's queue for a model whose every server is full (issue 44)."""
