"""Requests held, not refused, while a model has no ready server (an activator, as Knative's)."""
