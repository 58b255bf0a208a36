"""What a stored block costs the precise index's process (picker/kv_process.py) at its bound:
this checkout's index and journal runs (kvcache/index.py, kvcache/mirror.py's `runs`)
against those at `--baseline-rev` (loaded with `git show`), in one process, taking turns.

Each side fills a plain-dict index (the layout of the index's own process) to `--blocks`
with vLLM 0.32 batches of 1,000 fresh blocks of 16 tokens (read with kvcache/wire.py, as
the flood bench's publisher sends them), then applies `--rounds` x 50 more batches, every
stored block evicting the oldest: per round, CPU microseconds a block for applying the batch
(256 blocks a step, as the index's process does) and grouping its journal into runs. The
sides alternate round by round (first one, then the other), so that the machine's drift
falls on both; printed: each side's median and the ratio.

    .venv/bin/python bench/picker/kv_index_cost.py                          # against HEAD
    .venv/bin/python bench/picker/kv_index_cost.py --baseline-rev f3dbcc6 --blocks 100000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.revisions import module_at  # noqa: E402
from controlplane.kvcache import index as index_now  # noqa: E402
from controlplane.kvcache import mirror as mirror_now  # noqa: E402
from controlplane.kvcache import wire  # noqa: E402

BASELINE_REV = "HEAD"  # a change in the working tree against the last commit
PER_BATCH = 1000
BATCHES_PER_ROUND = 50


def batches(n: int, seed: int = 1) -> list[wire.Batch]:
    """`n` batches of PER_BATCH fresh blocks, each chained from the last, as the flood's."""
    rng = random.Random(seed)
    tokens = [rng.randrange(32000) for _ in range(16 * PER_BATCH)]
    out, parent = [], None
    for seq in range(n):
        hashes = [rng.getrandbits(63) for _ in range(PER_BATCH)]
        tokens[rng.randrange(len(tokens))] = rng.randrange(32000)
        frames = wire.frames(seq, time.time(), [wire.stored(hashes, parent, tokens, 16)])
        out.append(wire.read(list(frames)))
        parent = hashes[-1]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-rev", default=BASELINE_REV, help="git revision to compare with")
    p.add_argument("--blocks", type=int, default=1 << 20, help="the index's bound (default: %(default)s)")
    p.add_argument(
        "--rounds", type=int, default=8, help="rounds of 50 batches per side (default: %(default)s)"
    )
    a = p.parse_args(argv)
    fill = a.blocks // PER_BATCH + 50
    work = batches(fill + a.rounds * BATCHES_PER_ROUND)
    sides: dict[str, tuple[Any, Any, Any]] = {}
    for name, index_mod, mirror_mod in (
        ("baseline", module_at(a.baseline_rev, "controlplane/kvcache/index.py", "index_baseline"), None),
        ("now", index_now, mirror_now),
    ):
        mirror_mod = mirror_mod or module_at(
            a.baseline_rev, "controlplane/kvcache/mirror.py", "mirror_baseline"
        )
        idx = index_mod.KvIndex(max_blocks=a.blocks, journal=[], sharded=False)
        for b in work[:fill]:
            index_mod.run(idx.apply_steps("a", b, 0.0, 256))
            idx.journal.clear()
        sides[name] = (index_mod, mirror_mod, idx)
    per_block: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(a.rounds):
        chunk = work[fill + r * BATCHES_PER_ROUND : fill + (r + 1) * BATCHES_PER_ROUND]
        for name in ("baseline", "now") if r % 2 == 0 else ("now", "baseline"):
            index_mod, mirror_mod, idx = sides[name]
            t = time.process_time()
            for b in chunk:
                index_mod.run(idx.apply_steps("a", b, 0.0, 256))
                mirror_mod.runs(idx.journal)
                idx.journal.clear()
            per_block[name].append((time.process_time() - t) / (len(chunk) * PER_BATCH) * 1e6)
    med = {name: statistics.median(v) for name, v in per_block.items()}
    for name, v in per_block.items():
        rev = a.baseline_rev if name == "baseline" else "this checkout"
        print(json.dumps({"side": name, "rev": rev, "us_per_block_median": round(med[name], 2),
                          "rounds": [round(x, 2) for x in v], "size": sides[name][2].size}))  # fmt: skip
    print(json.dumps({"now_over_baseline": round(med["now"] / med["baseline"], 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
