"""llama.cpp's LoRA adapters, read from its `GET /lora-adapters` (docs/signals.md#lora-adapters).

llama-server has no LoRA series on its /metrics page. It lists the adapters it loaded at
start (`--lora FILE`, `--lora-scaled FILE:SCALE`) at /lora-adapters:
`[{"id": 0, "path": "FILE", "scale": 1.0, "task_name": "", "prompt_prefix": ""}]`. An
adapter listed at a scale above 0 applies to every request on that server: it is resident
for as long as the server runs. `resident` names the fleet's adapters among those listed
(`lora_running`), none waiting, and `max_lora` the number listed (llama.cpp holds them all
at once); `fleet_names` says how a listed path is matched to the fleet's `source:`.

Asked only for a page recognised as llama.cpp's, of a model with `adapters:`, once that page
is read: one more GET per scrape, bounded as the page is (the same timeout, at most
limits.LLAMACPP_LORA_MAX_BYTES). An answer it cannot use (no answer, an HTTP error, not JSON,
not a list of adapters, over a bound) leaves the three unknown (None), never the rest of the
sample.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

from controlplane import limits
from controlplane.signals.parse import ServerSample
from controlplane.signals.probe import Probe, Prober

PATH = "/lora-adapters"
PATH_MAX_CHARS = 4096  # a listed adapter's path (Linux's PATH_MAX); a longer one is refused

# (running, waiting, slots), as parse.ServerSample's lora_running, lora_waiting, max_lora.
Adapters = tuple[tuple[str, ...] | None, tuple[str, ...] | None, int | None]
UNKNOWN: Adapters = (None, None, None)
# The fleet's adapters of a model: (name, source; "" without one), as Probe.adapters.
FleetAdapters = Sequence[tuple[str, str]]


def _file_name(path: str) -> str:
    """What follows a path's last '/' (trailing ones dropped): 'a/b/x.gguf' -> 'x.gguf'."""
    return path.rstrip("/").rpartition("/")[2]


def fleet_names(path: str, adapters: FleetAdapters) -> tuple[str, ...]:
    """The fleet's adapters a listed `path` is: those whose `source` is exactly `path`; else,
    as a fallback (a server started with another path to the same file: a relative one, a
    mount elsewhere), those whose source has the same file name, provided they all name one
    source (two different files of that name: ambiguous, none). Empty: not the fleet's."""
    exact = tuple(name for name, source in adapters if source and source == path)
    if exact or not path:
        return exact
    file = _file_name(path)
    if not file:
        return ()
    same_file = [(name, source) for name, source in adapters if source and _file_name(source) == file]
    if len({source for _, source in same_file}) != 1:
        return ()
    return tuple(name for name, _ in same_file)


def resident(body: bytes, adapters: FleetAdapters) -> Adapters:
    """The adapters a /lora-adapters answer says are applied: the fleet's names of every
    entry at a scale above 0 (`fleet_names`; in the server's order, repeats removed), no
    waiting ones, and the number of entries as the slots. Unknown, all three: a body over
    limits.LLAMACPP_LORA_MAX_BYTES, not JSON, not a list, more than
    limits.METRICS_LORA_MAX_ADAPTERS entries (or names), or an entry that is not an object
    with a string `path` of at most PATH_MAX_CHARS and a finite number `scale` (and, if it has
    an `id`, a whole number)."""
    if len(body) > limits.LLAMACPP_LORA_MAX_BYTES:
        return UNKNOWN
    try:
        listed = json.loads(body)
    except (ValueError, RecursionError):  # not JSON (or not text); nested past the parser's depth
        return UNKNOWN
    if not isinstance(listed, list) or len(listed) > limits.METRICS_LORA_MAX_ADAPTERS:
        return UNKNOWN
    names: dict[str, None] = {}
    for entry in listed:
        if not isinstance(entry, dict):
            return UNKNOWN
        path, scale, index = entry.get("path"), entry.get("scale"), entry.get("id", 0)
        if not isinstance(path, str) or len(path) > PATH_MAX_CHARS:
            return UNKNOWN
        # bool is an int to Python, not a number to JSON; a float from JSON may be inf or nan
        # (Python's reader takes Infinity and NaN); an int is finite however long.
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            return UNKNOWN
        if isinstance(scale, float) and not math.isfinite(scale):
            return UNKNOWN
        if isinstance(index, bool) or not isinstance(index, int):
            return UNKNOWN
        if scale > 0:
            names.update(dict.fromkeys(fleet_names(path, adapters)))
    if len(names) > limits.METRICS_LORA_MAX_ADAPTERS:
        return UNKNOWN
    return tuple(names), (), len(listed)


async def read(prober: Prober, address: str, probe: Probe, timeout_s: float) -> Adapters:
    """GET /lora-adapters of the server whose page `probe` reads, and what it says
    (`resident`); UNKNOWN without a 200 answer in `timeout_s`."""
    status, body, error = await prober.get(address, probe, PATH, timeout_s, limits.LLAMACPP_LORA_MAX_BYTES)
    if error is not None or status != 200 or body is None:
        return UNKNOWN
    return resident(body, probe.adapters)


def wanted(sample: ServerSample, probe: Probe) -> bool:
    """Whether the sample's adapters are read from /lora-adapters: a llama.cpp page, of a
    model with adapters."""
    return sample.dialect == "llamacpp" and bool(probe.adapters)


async def with_adapters(
    sample: ServerSample, prober: Prober, address: str, probe: Probe, timeout_s: float
) -> ServerSample:
    """The sample with its adapters read (`read`) when `wanted`; else the sample itself."""
    if not wanted(sample, probe):
        return sample
    running, waiting, slots = await read(prober, address, probe, timeout_s)
    return dataclasses.replace(sample, lora_running=running, lora_waiting=waiting, max_lora=slots)
