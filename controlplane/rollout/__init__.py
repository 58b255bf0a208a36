"""Model version rollouts: the pure state machine (its store, controller and API come next)."""
