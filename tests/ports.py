"""Free loopback ports for the tests' servers: the allocator the demo uses too (see
controlplane/sim/ports.py), so that a test's ports and a demo's it starts never clash."""

from controlplane.sim.ports import free_port, free_ports

__all__ = ["free_port", "free_ports"]
