"""Load and validate the fleet YAML. Every error names the file, the key path and the reason.

The way in: read the file (no further than the size limit), decode it as UTF-8, refuse YAML
that is an alias bomb or nests too deep, note the line of every key path (and every duplicate
key), then hand the document to the schema (controlplane.fleet.schema). All errors come back at
once, as FleetConfigInvalid."""

from __future__ import annotations

from pathlib import Path

import yaml

from controlplane import limits
from controlplane.fleet.errors import ConfigError, FleetConfigInvalid, _Errors
from controlplane.fleet.model import Fleet
from controlplane.fleet.schema import _fleet


def load_fleet(path: str | Path) -> Fleet:
    """Read and validate a fleet YAML file; raise FleetConfigInvalid listing every error."""
    return parse_fleet(decode_fleet(read_fleet_bytes(path), str(path)), str(path))


def read_fleet_bytes(path: str | Path) -> bytes:
    """A fleet file's bytes, read no further than one byte past the size limit (so that
    decode_fleet can refuse it); raise FleetConfigInvalid if it cannot be read."""
    try:
        with Path(path).open("rb") as f:
            return f.read(limits.FLEET_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise FleetConfigInvalid([ConfigError(str(path), "", f"cannot read file: {e}")]) from e


def _too_large(file: str) -> FleetConfigInvalid:
    why = f"file is over the {limits.FLEET_FILE_MAX_BYTES} byte limit (docs/limits.md)"
    return FleetConfigInvalid([ConfigError(file, "", why)])


def decode_fleet(data: bytes, file: str) -> str:
    """The file's text: UTF-8 (a UTF-8 BOM is allowed), at most FLEET_FILE_MAX_BYTES."""
    if len(data) > limits.FLEET_FILE_MAX_BYTES:
        raise _too_large(file)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        why = f"not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} (save the file as UTF-8)"
        raise FleetConfigInvalid([ConfigError(file, "", why, line)]) from None


def parse_fleet(text: str, file: str = "<fleet>") -> Fleet:
    """Validate fleet YAML text; raise FleetConfigInvalid listing every error."""
    if len(text) > limits.FLEET_FILE_MAX_BYTES:
        raise _too_large(file)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            _check_size(node, file)  # before anything expands aliases
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise FleetConfigInvalid([ConfigError(file, "", f"not valid YAML: {e}", line)]) from e
    except RecursionError:
        why = f"nested deeper than {limits.FLEET_MAX_DEPTH} levels (docs/limits.md)"
        raise FleetConfigInvalid([ConfigError(file, "", why)]) from None
    lines: dict[str, int] = {}
    dupes: list[tuple[str, int]] = []
    if node is not None:
        _index_lines(node, "", lines, dupes)
    errs = _Errors(file, lines)
    for path, line in dupes:
        errs.items.append(ConfigError(file, path, "duplicate key", line))
    fleet = _fleet(data, errs)
    if errs.items or fleet is None:
        raise FleetConfigInvalid(errs.items)
    return fleet


def _check_size(root: yaml.Node, file: str) -> None:
    """Refuse a document whose nodes, counting every expansion of every alias, exceed
    FLEET_MAX_NODES, or that nests deeper than FLEET_MAX_DEPTH: an alias bomb of a few
    hundred bytes would otherwise expand to billions of nodes in whatever walks it."""
    count = 0
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > limits.FLEET_MAX_NODES:
            why = (
                f"more than {limits.FLEET_MAX_NODES} YAML nodes once aliases are expanded "
                "(an alias bomb, or a file far larger than a fleet needs; docs/limits.md)"
            )
            raise FleetConfigInvalid([ConfigError(file, "", why, node.start_mark.line + 1)])
        if depth > limits.FLEET_MAX_DEPTH:
            why = f"nested deeper than {limits.FLEET_MAX_DEPTH} levels (docs/limits.md)"
            raise FleetConfigInvalid([ConfigError(file, "", why, node.start_mark.line + 1)])
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack.append((k, depth + 1))
                stack.append((v, depth + 1))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, depth + 1) for v in node.value)


def _index_lines(node: yaml.Node, path: str, out: dict[str, int], dupes: list[tuple[str, int]]) -> None:
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for k, v in node.value:
            key = str(k.value)
            child = f"{path}.{key}" if path else key
            if key in seen:
                dupes.append((child, k.start_mark.line + 1))
            seen.add(key)
            out.setdefault(child, k.start_mark.line + 1)
            _index_lines(v, child, out, dupes)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _index_lines(v, f"{path}[{i}]", out, dupes)
