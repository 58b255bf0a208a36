"""Pure translation: fleet (and endpoint weights) -> Envoy Listener, Route, Cluster, CLA."""
