"""The fleet file's bounds (controlplane/limits.py, docs/limits.md): hostile and careless
input gets a precise error naming the field, never a traceback, never an unbounded cost
(issue 16's findings F1, F2, F3, F8, F9 and F10 for the fleet file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane import limits
from controlplane.cli.main import main
from controlplane.fleet import FleetConfigInvalid, load_fleet, parse_fleet
from controlplane.fleet.watch import FleetFileWatcher, parse_file_bytes
from controlplane.resources.names import GATEWAY_LISTENER, stat_name

BASE = """\
listener: {port: 10000}
tiers:
  small: {max_params_b: 15, timeout: 60s}
models:
  llama:
    params_b: 8
    stable: v1
    versions:
      v1:
        endpoints: ['127.0.0.1:8101', '127.0.0.1:8102']
"""


def fleet(tier: str = "", model: str = "", top: str = "", name: str = "llama") -> str:
    text = BASE.replace("timeout: 60s}", f"timeout: 60s{tier}}}").replace(
        "    params_b: 8\n", f"    params_b: 8\n{model}"
    )
    return text.replace("  llama:", f"  {name}:") + top


def errors_of(text: str) -> list[str]:
    with pytest.raises(FleetConfigInvalid) as e:
        parse_fleet(text, "fleet.yaml")
    return [str(x) for x in e.value.errors]


def one_error(text: str, path: str, reason: str) -> None:
    errs = errors_of(text)
    assert any(f": {path}: " in e and reason in e for e in errs), errs


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_numbers_are_refused_where_they_appear(value: str) -> None:
    one_error(
        fleet(top=f"gpu_classes: {{A100: {{capacity: {value}}}}}\n"), "gpu_classes.A100.capacity", "finite"
    )
    one_error(fleet(model=f"    memory_gb: {value}\n"), "models.llama.memory_gb", "expected a finite number")
    one_error(fleet().replace("params_b: 8", f"params_b: {value}"), "models.llama.params_b", "finite")
    one_error(
        fleet().replace("max_params_b: 15", f"max_params_b: {value}"), "tiers.small.max_params_b", "finite"
    )
    one_error(
        fleet().replace("'127.0.0.1:8101'", f"{{address: '127.0.0.1:8101', capacity: {value}}}"),
        "models.llama.versions.v1.endpoints[0].capacity",
        "finite",
    )


def test_numbers_beyond_meaning_are_refused() -> None:
    one_error(
        fleet().replace("params_b: 8", "params_b: 1.0e+308"), "models.llama.params_b", "must be at most 1e+06"
    )
    one_error(
        fleet().replace("params_b: 8", "params_b: 1e308"), "models.llama.params_b", "write it as 1.0e+3"
    )


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (".nan", "expected a finite duration, got nan"),
        (".inf", "expected a finite duration, got inf"),
        ("99999999999999h", "must be at most 30 days (720h), got '99999999999999h'"),
        ("0.0000000001s", "must be at least 1ms, got '0.0000000001s' (shorter rounds to 0"),
        ("1e308", "expected a duration such as 60s, 500ms, 3m; got '1e308'"),
    ],
)
def test_durations_are_finite_and_within_envoys_range(value: str, reason: str) -> None:
    one_error(fleet(tier=f", stream_idle_timeout: {value}"), "tiers.small.stream_idle_timeout", reason)


def test_the_largest_and_smallest_durations_accepted() -> None:
    for ok in ("720h", "1ms"):
        parse_fleet(fleet(tier=f", stream_idle_timeout: {ok}"))


@pytest.mark.parametrize(
    ("signals", "path", "reason"),
    [
        ("{interval: 1ms, timeout: 1ms}", "signals.interval", "must be between 50ms and 300s"),
        ("{interval: .inf}", "signals.interval", "finite"),
        ("{interval: .nan}", "signals.interval", "finite"),
        ("{interval: 1h}", "signals.interval", "must be between"),
        ("{interval: 1s, timeout: 1ms}", "signals.timeout", "must be at least 10ms"),
    ],
)
def test_signals_interval_and_timeout_are_bounded(signals: str, path: str, reason: str) -> None:
    one_error(fleet(top=f"signals: {signals}\n"), path, reason)


def test_an_alias_bomb_is_refused_before_it_expands() -> None:
    levels = ["a: &a [x,x,x,x,x,x,x,x,x]"]
    levels += [f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
    bomb = "\n".join(levels) + "\n"
    assert len(bomb) <= 342  # 9 levels: 9^9 = 387 million nodes once expanded
    errs = errors_of(bomb)
    assert len(errs) == 1 and f"more than {limits.FLEET_MAX_NODES} YAML nodes" in errs[0], errs
    # Aliases themselves are fine in a fleet of ordinary size.
    anchored = fleet().replace("timeout: 60s}", "timeout: &t 60s}")
    parse_fleet(anchored.replace("    params_b: 8\n", "    params_b: 8\n    timeout: *t\n"))


@pytest.mark.parametrize("text", ["[" * 5000, "{a: " * 3000, "- " * 100 + "x"])
def test_deep_nesting_is_a_precise_error(text: str) -> None:
    errs = errors_of(text)
    assert any("nested deeper than" in e or "not valid YAML" in e for e in errs), errs


@pytest.mark.parametrize(
    "data",
    [bytes(range(256)) * 4, "models: {}\n".encode("utf-16"), b"tiers: {small: {}}\n\xff\xfe\n"],
)
def test_bytes_that_are_not_utf8_are_a_precise_error_in_the_loader_the_watcher_and_the_cli(
    tmp_path: Path, data: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_bytes(data)
    with pytest.raises(FleetConfigInvalid) as e:
        load_fleet(path)
    assert "not UTF-8 text: byte 0x" in str(e.value)
    result = parse_file_bytes(data, str(path))
    assert isinstance(result, FleetConfigInvalid)
    refused: list[FleetConfigInvalid] = []
    FleetFileWatcher(path, lambda f: None, refused.append).check()
    assert len(refused) == 1  # counted as an invalid reload (config_valid 0, the alert)
    assert main(["check-config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "not UTF-8 text" in err


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_bytes(b"# comment\n" * (limits.FLEET_FILE_MAX_BYTES // 10 + 1))
    with pytest.raises(FleetConfigInvalid) as e:
        load_fleet(path)
    assert "byte limit" in str(e.value)


def test_a_loader_bug_is_an_invalid_file_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(text: str, file: str = "") -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("controlplane.fleet.watch.parse_fleet", broken)
    result = parse_file_bytes(fleet().encode(), "fleet.yaml")
    assert isinstance(result, FleetConfigInvalid) and "ZeroDivisionError: a bug" in str(result)


def test_name_collisions_are_refused() -> None:
    assert GATEWAY_LISTENER == "inference"
    one_error(fleet(name="inference"), "models.inference", "is reserved")
    assert stat_name("a.b") == stat_name("a_b")
    second = BASE[BASE.index("  llama:") :].replace("llama", "a_b").replace("127.0.0.1", "127.0.9.1")
    one_error(fleet(name="a.b") + second, "models.a_b", "stat name 'a_b' is the same as model 'a.b''s")
    one_error(fleet(name="yes"), "models", "model names must be strings, got True")
    one_error(fleet(name="~"), "models", "model names must be strings, got None")


def test_ports_in_other_digits_and_mapped_ipv4_duplicates_are_refused() -> None:
    arabic = fleet().replace("127.0.0.1:8101", "127.0.0.1:\u0668\u0661\u0660\u0661")
    one_error(arabic, "models.llama.versions.v1.endpoints[0].address", "port must be 1-65535")
    mapped = fleet().replace("'127.0.0.1:8102'", "'[::ffff:127.0.0.1]:8101'")
    one_error(mapped, "models.llama.versions.v1.endpoints[1].address", "duplicate endpoint")


def test_control_characters_in_names_are_escaped_in_errors() -> None:
    errs = errors_of(fleet(name='"bad\\nname\\0"'))
    assert errs and all("\n" not in e and "\0" not in e for e in errs), errs
    assert any("bad\\nname\\x00" in e for e in errs), errs
