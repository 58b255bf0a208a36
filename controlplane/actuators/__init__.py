"""Actuators: what turns the autoscaler's desired replicas into servers started and
stopped. `emulator.py` starts emulated servers on this machine (the demo and the tests,
`autoscaling: {provider: emulator}`); a production actuator (Kubernetes, a cloud's instance
groups) would sit beside it. Most fleets need none here: KEDA or the HPA read the desired
replicas (admin/keda.py) and their own controllers act."""
