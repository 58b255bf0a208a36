"""How the control plane's own processes run: the one stop-signal loop (SIGINT, SIGTERM)
every long-running command waits on, and the runner of the side services (`controlplane
picker`, `controlplane ratelimit`). No domain logic here."""
