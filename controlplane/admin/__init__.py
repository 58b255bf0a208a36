"""The operator gRPC API (controlplane.v1) and KEDA's external scaler: authentication and the
thin servicers."""
