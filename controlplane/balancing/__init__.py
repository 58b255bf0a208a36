"""balancing room."""
