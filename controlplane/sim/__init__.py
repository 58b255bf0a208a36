"""Stand-ins for what cannot run here (GPU model servers), and the demo."""
