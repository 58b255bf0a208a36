"""signals room."""
