"""How many replicas each model wants (pure): Knative-style windows over its demand."""
