"""The vocabulary of what the control plane sends: xDS type URLs and the generated
resources' names. Pure, and below every room that builds, sends or validates resources
(fleet, routing, xds, hold, signals, picker, obs), so each imports it without importing
another room."""
