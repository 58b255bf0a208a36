"""The `controlplane` commands, one module per command (serve.py is `controlplane serve`):
each adds its own subparser (`add_parser`) and runs it (`run`). main.py assembles them."""
