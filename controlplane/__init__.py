"""An xDS control plane for AI inference traffic."""

__version__ = "0.1.0"
