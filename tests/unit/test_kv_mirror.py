"""kvcache/mirror.py: the picker's copy of the precise index, kept from the index's journal,
holds exactly the keys and block sizes the index holds, whatever the batches did (stores
chained or orphaned, removals, clears, restarts, gaps forgotten, the bound evicting), and
answers a prompt's match as the index does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.kvcache import wire
from controlplane.kvcache.blocks import prompt_keys, root
from controlplane.kvcache.index import KvIndex
from controlplane.kvcache.mirror import ADD, PUBLISHED, REMOVE, KvMirror, runs
from controlplane.kvcache.table import KeyTable, table_bytes
from controlplane.kvcache.writer import TableWriter

SERVERS = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")


def snapshot(index: KvIndex) -> tuple[dict[str, set[int]], dict[str, int]]:
    keys = {
        s: set(st.keys) if isinstance(st.keys, dict) else st.keys.keys() for s, st in index.streams.items()
    }
    sizes = {s: st.block_size for s, st in index.streams.items() if st.block_size is not None}
    return {s: k for s, k in keys.items() if k}, sizes


def fed(mirror: KvMirror, index: KvIndex, most: int = 5, shared: Shared | None = None) -> set[str]:
    """The index's journal to `mirror`; with `shared`, to a mirror reading a table that a
    TableWriter keeps too, as the picker and the index's process share one."""
    assert index.journal is not None
    pending = runs(index.journal, most)
    published = mirror.apply(pending)
    if shared is not None:
        reader, writer = shared
        assert reader.apply(writer.apply(pending)) == published
        if writer.table.full():
            writer.rebuild({s: st.blocks.values() for s, st in index.streams.items()})
        reader.set_counts(writer.held_counts())
    index.journal.clear()
    return published


Shared = tuple[KvMirror, TableWriter]


def shared_table(bound: int, capacity: int = 1024) -> Shared:
    """A mirror reading a table, and the writer of that table (two views of one buffer)."""
    buffer = bytearray(table_bytes(capacity))
    reader = KvMirror(max_blocks=bound, table=KeyTable(buffer, create=True, capacity=capacity))
    return reader, TableWriter(KeyTable(buffer))


# An op: (server, kind, a), kind: store a chain of `a` blocks after the server's last stored
# block (or from a prompt's start), remove its `a`-th newest block, clear it, restart it (its
# sequence numbers start over), or skip a batch (a gap: the index is told to forget it).
OPS = st.lists(
    st.tuples(
        st.sampled_from(SERVERS),
        st.sampled_from(["store", "root", "remove", "clear", "restart", "gap", "size"]),
        st.integers(1, 6),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(3, 40), st.booleans())
def test_the_mirror_holds_what_the_index_holds(
    ops: list[tuple[str, str, int]], bound: int, sharded: bool
) -> None:
    """Whether the index keeps its maps Sharded (in the picker's process) or in plain dicts
    (in its own: picker/kv_process.py); and a mirror reading the shared table that the index's
    process writes (rebuilt now and then) answers every server's chain as the index does."""
    index = KvIndex(max_blocks=bound, journal=[], sharded=sharded)
    mirror = KvMirror(max_blocks=bound)
    shared = shared_table(bound)
    reader, writer = shared
    seq = dict.fromkeys(SERVERS, -1)
    last: dict[str, list[int]] = {s: [] for s in SERVERS}
    counter = 0
    for n, (server, kind, a) in enumerate(ops):
        events: list[dict[str, object]] = []
        if kind in ("store", "root", "size"):
            hashes = [counter + i for i in range(a)]
            counter += a
            parent = last[server][-1] if kind == "store" and last[server] else None
            size = 8 if kind == "size" else 4  # another block size is refused
            events.append(wire.stored(hashes, parent, [h % 97 for h in hashes for _ in range(size)], size))
            last[server] += hashes
        elif kind == "remove" and last[server]:
            events.append(wire.removed([last[server][-min(a, len(last[server]))]]))
        elif kind == "clear":
            events.append(wire.cleared())
        if kind == "restart":
            seq[server] = -1
            last[server] = []
        if kind == "gap":
            index.forget(server)
            seq[server] = -1
            last[server] = []
            continue
        seq[server] += 1
        index.apply(server, wire.read(wire.frames(max(seq[server], 0), 0.0, events)), 0.0)
        assert server in fed(mirror, index, shared=shared)
        if n % 5 == 4:
            writer.rebuild({s: st.blocks.values() for s, st in index.streams.items()})
            reader.set_counts(writer.held_counts())
        for chain_of in SERVERS:
            stream = index.streams.get(chain_of)
            # The chain as stored, a block removed or evicted since standing in as a miss.
            keys = (
                [k if (k := stream.blocks.get(h)) is not None else 7 for h in last[chain_of]]
                if stream
                else []
            )
            for s in SERVERS:
                assert reader.held(s, keys) == index.held(s, keys), (s, chain_of)
            sizes_asked = {4: keys, 8: keys}
            assert reader.matched(SERVERS, sizes_asked) == index.matched(SERVERS, sizes_asked)
        keys, sizes = snapshot(index)
        assert {s: mirror.server_keys(s) for s in mirror.keys if mirror.server_keys(s)} == keys
        assert mirror.sizes == sizes
        assert mirror.size == index.size <= bound
        for s in SERVERS:
            assert mirror.held_blocks(s) == index.held_blocks(s) == reader.held_blocks(s)
            assert mirror.block_size(s) == index.block_size(s) == reader.block_size(s)


def test_a_prompt_matches_in_the_mirror_as_in_the_index() -> None:
    index = KvIndex(journal=[])
    mirror = KvMirror(max_blocks=index.max_blocks)
    prompt = list(range(64))
    index.apply(
        SERVERS[0], wire.read(wire.frames(0, 0.0, [wire.stored([1, 2, 3], None, prompt[:48], 16)])), 0.0
    )
    index.apply(SERVERS[1], wire.read(wire.frames(0, 0.0, [wire.stored([9], None, prompt[:16], 16)])), 0.0)
    lora = [wire.stored([5], None, prompt[:16], 16, lora="sql")]
    index.apply(SERVERS[2], wire.read(wire.frames(0, 0.0, lora)), 0.0)
    fed(mirror, index)
    ask = {16: prompt_keys(prompt, 16)}
    assert (
        mirror.matched(SERVERS, ask)
        == index.matched(SERVERS, ask)
        == {
            SERVERS[0]: 3,
            SERVERS[1]: 1,
            SERVERS[2]: 0,
        }
    )
    assert mirror.matched(SERVERS[2:], {16: prompt_keys(prompt, 16, "sql")}) == {SERVERS[2]: 1}
    mirror.keep_only(SERVERS[:1])
    assert mirror.matched(SERVERS, ask) == {SERVERS[0]: 3, SERVERS[1]: 0, SERVERS[2]: 0}


def test_an_adapters_root_is_the_same_in_every_process() -> None:
    import subprocess
    import sys

    code = "from controlplane.kvcache.blocks import root; print(root('sql'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(other.stdout) == root("sql") != root(None)


def test_runs_merge_a_servers_consecutive_keys_up_to_a_most() -> None:
    a, b = SERVERS[:2]
    journal = [
        (ADD, a, 1),
        (ADD, a, 2),
        (ADD, a, 3),
        (ADD, b, 4),
        (REMOVE, a, 1),
        (REMOVE, a, 2),
        (PUBLISHED, a, 0),
    ]
    assert runs(journal, most=2) == [
        [ADD, a, [1, 2]],
        [ADD, a, [3]],
        [ADD, b, [4]],
        [REMOVE, a, [1, 2]],
        [PUBLISHED, a, [0]],
    ]


def test_a_journal_past_twice_the_bound_clears_the_mirror() -> None:
    mirror = KvMirror(max_blocks=2)
    mirror.apply([[ADD, SERVERS[0], [1, 2, 3, 4]]])
    assert mirror.size == 4
    mirror.apply([[ADD, SERVERS[0], [5]]])
    assert mirror.size == 0 and mirror.keys == {} and mirror.overflows == 1


def test_the_mirrors_bytes_per_block_are_as_documented() -> None:
    import gc
    import tracemalloc

    import msgspec

    from controlplane.kvcache.mirror import BYTES_PER_KEY

    mirror = KvMirror(max_blocks=1 << 20)
    n = 20_000
    keys = [(i * 2654435761) % (1 << 63) - (1 << 62) for i in range(n)]  # as block_key's: any 64 bits
    # As the picker gets them: decoded from the index process's messages (new integers).
    messages = [msgspec.msgpack.encode([[ADD, SERVERS[0], keys[i : i + 1000]]]) for i in range(0, n, 1000)]
    del keys
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for message in messages:
        mirror.apply(msgspec.msgpack.decode(message))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    per_key = sum(s.size_diff for s in after.compare_to(before, "filename")) / n
    assert mirror.size == n
    assert not any(gc.is_tracked(shard) for shard in mirror.keys[SERVERS[0]])  # no full collection walks it
    print(f"{per_key:.0f} bytes per key")
    assert BYTES_PER_KEY * 0.5 <= per_key <= BYTES_PER_KEY * 1.2, per_key


def test_steps_apply_as_apply_does_a_step_at_a_time() -> None:
    one, stepped = KvMirror(max_blocks=100), KvMirror(max_blocks=100)
    ops = [[ADD, SERVERS[0], list(range(10))], [REMOVE, SERVERS[0], [3, 4]], [PUBLISHED, SERVERS[1], [0]]]
    one.apply(ops)
    seen = list(stepped.steps(ops, step=4))
    assert len(seen) == 3 + 1 + 1 and seen[-1] == {SERVERS[1]}
    assert stepped.keys == one.keys and stepped.size == one.size == 8
    assert stepped.server_keys(SERVERS[0]) == set(range(10)) - {3, 4}


def test_a_cleared_server_holds_nothing_in_the_table_before_the_picker_hears_of_it() -> None:
    """The table changes at once, the picker hears of a CLEAR up to a flush later: meanwhile it
    reads the server's old slot at its new epoch, which holds nothing; and a slot is given
    again only after every other, never to the next server that comes."""
    from controlplane.kvcache.mirror import CLEAR, SLOT

    reader, writer = shared_table(100)
    told = writer.apply([[ADD, "a", [11, 12, 13]]])
    assert told == [[SLOT, "a", [0]]]
    reader.apply(told)
    reader.sizes["a"] = 16
    assert reader.held("a", [11, 12, 13]) == 3
    later = writer.apply([[CLEAR, "a", [0]], [ADD, "b", [11, 12, 13]], [ADD, "a", [11]]])
    assert reader.held("a", [11, 12, 13]) == 0  # not yet told: the old slot, its new epoch
    assert later == [[CLEAR, "a", [0]], [SLOT, "b", [1]], [SLOT, "a", [2]]]
    reader.apply(later)
    assert reader.held("a", [11, 12, 13]) == 1 and reader.held("b", [11, 12, 13]) == 3
