"""Pure balancing policies: endpoint loads -> EDS weights, and smoothing across updates."""
