"""sim room."""
