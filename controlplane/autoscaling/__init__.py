"""How many replicas each model and version wants (pure): Knative-style windows over demand,
forecasts for pre-warm, and which replicas to drain and stop; persist.py keeps the forecasts'
history on disk."""
