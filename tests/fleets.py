"""Fleet YAML texts shared by tests."""

from __future__ import annotations

BASIC = """\
listener: {port: 10000}
tiers:
  small:  {max_params_b: 15, timeout: 60s}
  medium: {max_params_b: 80, timeout: 180s}
  large:  {timeout: 600s}
models:
  llama-3-8b:
    params_b: 8
    stable: v1
    versions:
      v1:
        endpoints:
          - {address: 127.0.0.1:8101, gpu: A100, gpu_memory_gb: 80}
          - {address: 127.0.0.1:8102}
      v2:
        endpoints: [{address: "127.0.0.1:8103"}]
"""


def fleet_yaml(
    models: dict[str, dict[str, list[str]]],
    *,
    port: int = 10000,
    stable: dict[str, str] | None = None,
    extra_model_keys: dict[str, str] | None = None,
) -> str:
    """A fleet YAML with the given models -> versions -> endpoint addresses."""
    lines = [
        f"listener: {{port: {port}}}",
        "tiers:",
        "  small: {max_params_b: 15, timeout: 30s}",
        "  large: {timeout: 120s}",
        "models:",
    ]
    for model, versions in models.items():
        first = next(iter(versions))
        lines.append(f"  {model}:")
        lines.append("    params_b: 8")
        lines.append(f"    stable: {(stable or {}).get(model, first)}")
        if extra_model_keys and model in extra_model_keys:
            lines.append(f"    {extra_model_keys[model]}")
        lines.append("    versions:")
        for version, addrs in versions.items():
            lines.append(f"      {version}:")
            lines.append(f"        endpoints: [{', '.join(repr(a) for a in addrs)}]")
    return "\n".join(lines) + "\n"
