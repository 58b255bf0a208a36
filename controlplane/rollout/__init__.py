"""Model version rollouts: the pure state machine and its SQLite store (the controller and API come next)."""
