"""xDS: snapshots, the per-stream protocol (pure), the reconcile loop and the grpc.aio servicers."""
