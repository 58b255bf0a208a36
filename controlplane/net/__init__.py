"""The seams to the outside network: the one place each kind of client that leaves the process
is built (http.py: every HTTP client). Tests that cannot run a real peer swap the transport
here, and nowhere else."""
