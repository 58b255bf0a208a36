"""Resolve a version's DNS name (A/AAAA) or SRV name with dnspython (the I/O shell).

`resolve` answers `DnsAnswer(found, ttl)` for a definite answer, an empty one included
(NXDOMAIN, or no records of the type: authoritative), and raises `DnsFailure` when there is
no answer to trust (a timeout, no nameserver answering, a SERVFAIL). The caller decides what
an empty answer means (discovery/state.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.resolver

from controlplane.discovery.state import Found
from controlplane.fleet.model import Discover, DiscoverySettings

TIMEOUT_S = 2.0  # per query, all nameservers included


class DnsFailure(Exception):
    """No answer to trust."""


@dataclass(frozen=True)
class DnsAnswer:
    found: tuple[Found, ...]
    ttl: float  # the smallest TTL of the records used (of the SOA minimum when empty, else 0)


def resolver_for(settings: DiscoverySettings) -> dns.asyncresolver.Resolver:
    """The system resolver, or the fleet's `discovery.dns.nameservers`."""
    if not settings.nameservers:
        r = dns.asyncresolver.Resolver()
    else:
        r = dns.asyncresolver.Resolver(configure=False)
        r.nameservers = [dns.nameserver.Do53Nameserver(host, port) for host, port in settings.nameservers]
    r.lifetime = TIMEOUT_S
    r.timeout = TIMEOUT_S
    r.cache = None  # the TTL is ours to honour: every query asks
    return r


async def _addresses(r: dns.asyncresolver.Resolver, name: str) -> tuple[list[str], float | None]:
    """(addresses, smallest TTL) of `name`'s A and AAAA records. One type failing while the
    other has records is fine (a resolver that refuses AAAA for an IPv4-only name); both
    failing, or one failing while the other is empty, is no answer to trust."""
    out: list[str] = []
    ttl: float | None = None
    failure: str | None = None
    for rtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
        try:
            answer = await r.resolve(name, rtype, search=False, raise_on_no_answer=False)
        except dns.resolver.NXDOMAIN:
            continue
        except (dns.exception.Timeout, dns.resolver.NoNameservers, dns.resolver.YXDOMAIN) as e:
            failure = f"{dns.rdatatype.to_text(rtype)} {name}: {type(e).__name__}: {e}"
            continue
        if answer.rrset is not None:
            out += [rd.address for rd in answer.rrset]
            ttl = answer.rrset.ttl if ttl is None else min(ttl, answer.rrset.ttl)
    if failure is not None and not out:
        raise DnsFailure(failure)
    return out, ttl


async def resolve(
    d: Discover, settings: DiscoverySettings, r: dns.asyncresolver.Resolver | None = None
) -> DnsAnswer:
    r = r or resolver_for(settings)
    if d.kind == "dns":
        assert d.port is not None
        hosts, ttl = await _addresses(r, d.name)
        return DnsAnswer(tuple(Found(h, d.port, origin=d.name) for h in sorted(set(hosts))), float(ttl or 0))
    try:
        answer = await r.resolve(d.name, dns.rdatatype.SRV, search=False, raise_on_no_answer=False)
    except dns.resolver.NXDOMAIN:
        return DnsAnswer((), 0.0)
    except (dns.exception.Timeout, dns.resolver.NoNameservers, dns.resolver.YXDOMAIN) as e:
        raise DnsFailure(f"SRV {d.name}: {type(e).__name__}: {e}") from e
    if answer.rrset is None:
        return DnsAnswer((), 0.0)
    ttl = float(answer.rrset.ttl)
    servers: list[Found] = []
    for rd in answer.rrset:
        target = rd.target.to_text(omit_final_dot=True)
        hosts, t = await _addresses(r, target)
        if t is not None:
            ttl = min(ttl, t)
        servers += [Found(h, int(rd.port), origin=f"{d.name} -> {target}") for h in hosts]
    unique = {f.address: f for f in servers}
    return DnsAnswer(tuple(unique[a] for a in sorted(unique)), ttl)
