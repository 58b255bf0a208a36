"""xds room."""
