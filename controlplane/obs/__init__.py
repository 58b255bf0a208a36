"""Observability: Prometheus metrics, the status HTTP server, structlog setup."""
