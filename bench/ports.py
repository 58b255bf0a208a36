"""Free loopback ports for the benchmarks' servers and Envoys: below the kernel's ephemeral
range, claimed per process (see controlplane/sim/ports.py)."""

from controlplane.sim.ports import free_port, free_ports

__all__ = ["free_port", "free_ports"]
