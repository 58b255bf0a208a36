"""Model version rollouts: the state machine and the step analysis (pure), the API layer over
the fleet file (overlay), the SQLite store, and the controller that drives them from operator
commands and ticks (the operator API over it: admin/; the etcd store: ha/)."""
