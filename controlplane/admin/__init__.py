"""The operator gRPC API (controlplane.v1): authentication and the thin servicers."""
