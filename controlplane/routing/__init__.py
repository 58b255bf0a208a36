"""routing room."""
