"""rollout room."""
