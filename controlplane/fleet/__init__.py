"""The world as configured: models, tiers, versions, endpoints; the fleet file read and checked
with exact errors, and watched for edits."""

from controlplane.fleet.errors import ConfigError, FleetConfigInvalid
from controlplane.fleet.loader import load_fleet, parse_fleet
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
