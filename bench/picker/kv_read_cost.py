"""What a pick's read of the precise index costs the picker: the shared key table
(kvcache/table.py, the default) against the picker's own copy of the keys in dicts (the
layout without a memfd), in one process, taking turns.

Both hold `--blocks` keys over `--servers` servers (as the index's process leaves them at its
bound), one server holding the whole of each prompt asked; per prompt length, the median of
`--rounds` rounds of `KvMirror.matched` over every server, in microseconds, and the ratio.

    .venv/bin/python bench/picker/kv_read_cost.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controlplane.kvcache.mirror import ADD, KvMirror  # noqa: E402
from controlplane.kvcache.table import KeyTable, capacity_for, table_bytes  # noqa: E402
from controlplane.kvcache.writer import TableWriter  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=1 << 20, help="keys held in all (default: %(default)s)")
    p.add_argument("--servers", type=int, default=8, help="servers (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2000, help="reads per prompt length (default: %(default)s)")
    a = p.parse_args(argv)
    rng = random.Random(1)
    servers = [f"127.0.0.1:{8000 + i}" for i in range(a.servers)]
    per = a.blocks // a.servers
    held = {s: [rng.getrandbits(63) for _ in range(per)] for s in servers}

    dicts = KvMirror(max_blocks=a.blocks)
    dicts.apply([[ADD, s, keys] for s, keys in held.items()])
    capacity = capacity_for(a.blocks)
    buffer = bytearray(table_bytes(capacity))
    table = KvMirror(max_blocks=a.blocks, table=KeyTable(buffer, create=True, capacity=capacity))
    writer = TableWriter(KeyTable(buffer))
    table.apply(writer.apply([[ADD, s, keys] for s, keys in held.items()]))
    for mirror in (dicts, table):
        mirror.sizes.update(dict.fromkeys(servers, 16))

    out = []
    for length in (4, 20, 64, 300):
        prompt = {16: held[servers[0]][:length]}
        assert dicts.matched(servers, prompt) == table.matched(servers, prompt)
        times: dict[str, list[float]] = {"dicts": [], "table": []}
        for _ in range(a.rounds):
            for name, mirror in (("dicts", dicts), ("table", table)):
                t0 = time.perf_counter()
                mirror.matched(servers, prompt)
                times[name].append(time.perf_counter() - t0)
        row = {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}
        out.append({"prompt_blocks": length, "us_dicts": row["dicts"], "us_table": row["table"],
                    "ratio": round(row["table"] / row["dicts"], 2)})  # fmt: skip
        print(json.dumps(out[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
