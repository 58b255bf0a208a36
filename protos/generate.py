"""Generate the operator API's Python code from protos/controlplane/v1/*.proto.

    python protos/generate.py          # write controlplane/v1/*_pb2*.py(i)
    python protos/generate.py --check  # exit 1 if the checked-in code is not current (CI)

Uses the grpcio-tools version pinned in pyproject's dev extra, so output is reproducible.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "controlplane" / "v1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc into `out_root` (which gets controlplane/v1/...); return the files written."""
    sources = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "controlplane" / "v1").glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / "controlplane" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        names = {p.name for p in fresh}
        current = {p.name for p in OUT.glob("*_pb2*.py*")}
        stale = sorted(
            n for n in names | current
            if n not in names or n not in current or not filecmp.cmp(OUT / n, Path(tmp) / "controlplane/v1" / n, shallow=False)
        )
        if args.check:
            if stale:
                print(
                    f"controlplane/v1 is not current with protos/ ({', '.join(stale)}); "
                    "run: python protos/generate.py",
                    file=sys.stderr,
                )
                return 1
            print("controlplane/v1 is current")
            return 0
        OUT.mkdir(parents=True, exist_ok=True)
        for n in current - names:
            (OUT / n).unlink()
        for p in fresh:
            (OUT / p.name).write_bytes(p.read_bytes())
        (OUT / "__init__.py").touch()
        print(f"wrote {len(fresh)} files to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
