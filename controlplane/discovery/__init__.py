"""Endpoint sources (DNS, Kubernetes) -> the same Endpoint values the fleet file gives."""
