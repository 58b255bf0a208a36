"""The per-request endpoint picker (`controlplane picker`): a process Envoy asks, through its
ext_proc filter, which server takes a request of a model with `balancing: picker`; Envoy
routes by the control plane's weights whenever it does not answer (docs/picker.md)."""
