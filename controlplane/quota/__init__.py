"""Per-tenant quotas: the limiter (pure) and the rate-limit service Envoy asks."""
