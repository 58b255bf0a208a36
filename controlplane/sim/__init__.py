"""Stand-ins for what cannot run here: the inference-server emulator and the provider that starts
it, discrete-event simulations of a fleet and of autoscaling, a traffic generator, and the demo."""
