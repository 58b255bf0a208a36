"""The command lines: `controlplane` (serve, check-config, explain, bootstrap, import, export,
demo, emulate) and `cpctl`, the operator API's client."""
