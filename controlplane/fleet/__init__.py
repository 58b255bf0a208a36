"""The world as configured: models, tiers, versions, endpoints; YAML loading with exact errors."""

from controlplane.fleet.loader import ConfigError, FleetConfigInvalid, load_fleet, parse_fleet
from controlplane.fleet.model import Endpoint, Fleet, ListenerSpec, Model, Tier, Version

__all__ = [
    "ConfigError",
    "Endpoint",
    "Fleet",
    "FleetConfigInvalid",
    "ListenerSpec",
    "Model",
    "Tier",
    "Version",
    "load_fleet",
    "parse_fleet",
]
