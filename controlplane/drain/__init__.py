"""Endpoint drains, beside rollouts: an operator (or discovery, or a scale-down) takes one
server out of service without dropping a request. The drain is stored with the rest of the
API state (rollout/store.py) and served through the same overlay (rollout/overlay.py); this
room decides when a draining endpoint is drained."""
