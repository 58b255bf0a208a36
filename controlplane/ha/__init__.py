"""Several control-plane replicas on etcd: shared state, leader election, the fleet in etcd."""
