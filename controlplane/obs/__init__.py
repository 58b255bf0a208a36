"""Observability: Prometheus metrics (per endpoint and per version rendered when scraped), the
status HTTP server, the event loop's lag, structlog setup."""
