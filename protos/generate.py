"""Generate the Python code of the gRPC APIs we serve from protos/controlplane/*/*.proto:
the operator API (controlplane/v1) and KEDA's external scaler contract (controlplane/keda).

    python protos/generate.py          # write controlplane/{v1,keda}/*_pb2*.py(i)
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
PACKAGES = ("controlplane/v1", "controlplane/keda")  # each: protos/<it>/*.proto -> <it>/*_pb2*


def generate(out_root: Path) -> list[Path]:
    """Run protoc into `out_root` (which gets controlplane/...); return the files written,
    relative to it."""
    sources = sorted(str(p.relative_to(PROTOS)) for pkg in PACKAGES for p in (PROTOS / pkg).glob("*.proto"))
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
    return sorted(p.relative_to(out_root) for pkg in PACKAGES for p in (out_root / pkg).glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = set(generate(Path(tmp)))
        current = {p.relative_to(ROOT) for pkg in PACKAGES for p in (ROOT / pkg).glob("*_pb2*.py*")}
        stale = sorted(
            str(n) for n in fresh | current
            if n not in fresh or n not in current or not filecmp.cmp(ROOT / n, Path(tmp) / n, shallow=False)
        )  # fmt: skip
        if args.check:
            if stale:
                print(
                    f"generated code is not current with protos/ ({', '.join(stale)}); "
                    "run: python protos/generate.py",
                    file=sys.stderr,
                )
                return 1
            print("generated code is current")
            return 0
        for n in current - fresh:
            (ROOT / n).unlink()
        for n in fresh:
            (ROOT / n).parent.mkdir(parents=True, exist_ok=True)
            (ROOT / n).write_bytes((Path(tmp) / n).read_bytes())
        for pkg in PACKAGES:
            (ROOT / pkg / "__init__.py").touch()
        print(f"wrote {len(fresh)} files to {', '.join(PACKAGES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
