"""Load signals from inference servers and Envoy: health and metrics probes, scraping in
collector processes or querying Prometheus, the servers' metrics dialects, the LRS server,
and the store that keeps each endpoint's load with its age."""
