"""`controlplane import` and `controlplane export`: the fleet between a file and etcd."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from controlplane.fleet.errors import FleetConfigInvalid
from controlplane.fleet.loader import load_fleet
from controlplane.ha.etcd import Etcd, StoreUrlInvalid, parse_store_url
from controlplane.ha.fleet import read_fleet_text, write_fleet_text
from controlplane.rollout.store import StoreUnavailable


def run_import(source: Path, target: str) -> int:
    """Validate `source`, then store it; 0 on success, 1 if refused or unreachable, 2 on usage."""
    try:
        url = parse_store_url(target)
    except StoreUrlInvalid as e:
        print(f"controlplane import: --to: {e}", file=sys.stderr)
        return 2
    try:
        fleet = load_fleet(source)
    except FleetConfigInvalid as e:
        for err in e.errors:
            print(err, file=sys.stderr)
        print(f"controlplane import: {source} is invalid; nothing was written", file=sys.stderr)
        return 1
    text = source.read_text()

    async def write() -> None:
        etcd = Etcd(url)
        try:
            await write_fleet_text(etcd, text)
        finally:
            await etcd.close()

    try:
        asyncio.run(write())
    except StoreUnavailable as e:
        print(f"controlplane import: {e}; nothing was written", file=sys.stderr)
        return 1
    endpoints = sum(len(v.endpoints) for m in fleet.models for v in m.versions)
    print(f"imported {source} into {url.where}/fleet: {len(fleet.models)} models, {endpoints} endpoints")
    return 0


def run_export(source: str, target: str) -> int:
    try:
        url = parse_store_url(source)
    except StoreUrlInvalid as e:
        print(f"controlplane export: --from: {e}", file=sys.stderr)
        return 2

    async def read() -> str | None:
        etcd = Etcd(url)
        try:
            return await read_fleet_text(etcd)
        finally:
            await etcd.close()

    try:
        text = asyncio.run(read())
    except StoreUnavailable as e:
        print(f"controlplane export: {e}", file=sys.stderr)
        return 1
    if text is None:
        print(f"controlplane export: no fleet at {url.where}/fleet (import one first)", file=sys.stderr)
        return 1
    if target == "-":
        sys.stdout.write(text)
    else:
        Path(target).write_text(text)
        print(f"exported {url.where}/fleet to {target}", file=sys.stderr)
    return 0
