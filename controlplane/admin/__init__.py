"""admin room."""
