"""The picker's subscriptions to the servers' KV events (thin I/O shell around kvcache/).

The control plane names each server's publisher in its EDS metadata (names.KV_METADATA_NS:
`events`, and `replay` where the server has a replay socket). For each, the picker keeps a
ZMQ SUB socket connected (ZMQ reconnects by itself), reads each message (kvcache/wire.py,
at most limits.KV_EVENT_MAX_BYTES: ZMQ drops a longer one before it is read), and applies it
to the precise index (choose.PickerState.kv_event):

- **a gap** is asked of the replay socket (a DEALER: `(b"", start)`, then batches until the
  end marker, at most REPLAY_TIMEOUT_S): filled, the batches are applied in order; not (no
  replay socket, no answer, or the replay no longer reaches back), the server's blocks are
  dropped (KvIndex.forget) and its stream starts again from the batch at hand;
- **a reconnection** (the socket's monitor sees a second connect: the publisher restarted, or
  the network dropped messages that no sequence number will show) drops the server's blocks;
- **a message that is not a batch** (WireError) is refused and counted; nothing of it is used.

Observation never starves serving: the subscriptions together spend at most BUSY_SHARE of
the loop's time on events (measured per BUSY_WINDOW_S; past it, each waits), a batch is
applied STEP_BLOCKS blocks at a time with the picks served between, and ZMQ keeps at most
RECEIVE_HWM messages per socket (past that, the publisher's messages are dropped, a gap the
next batch shows). The index's own bound holds its memory (kvcache/index.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping

import structlog
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controlplane import limits
from controlplane.kvcache import wire
from controlplane.kvcache.index import KvIndex
from controlplane.picker.choose import PickerState

log = structlog.get_logger("controlplane.picker.kv_events")

REPLAY_TIMEOUT_S = 1.0
RECEIVE_HWM = 100  # messages queued per subscription: at most 100 x limits.KV_EVENT_MAX_BYTES
BUSY_SHARE = 0.3  # of the event loop's time, every subscription together, at most
BUSY_WINDOW_S = 0.1
STEP_BLOCKS = 64  # blocks applied between two looks at the picks waiting (about 0.2 ms)
STEP_PAUSE_S = 0.0005  # between two steps the loop waits on its sockets: the GIL is free


# The families the subscriptions themselves count: where they run in a process of their own
# (kv_process.py), that process counts them and the picker exports what it last said.
EVENT_FAMILIES = (
    "controlplane_picker_kv_batches",
    "controlplane_picker_kv_replays",
    "controlplane_picker_kv_streams_lost",
    "controlplane_picker_kv_event_lag_seconds",
    "controlplane_picker_kv_publishers_connected",
    "controlplane_picker_kv_throttled_seconds",
)


class KvMetrics:
    """The precise index's metrics on registry `r`; with `events` False, EVENT_FAMILIES are
    kept off it (another process counts them: kv_process.KvProcessMetrics exports its)."""

    def __init__(self, r: CollectorRegistry, events: bool = True) -> None:
        counted = r if events else CollectorRegistry()  # EVENT_FAMILIES' registry
        self.batches = Counter(
            "controlplane_picker_kv_batches",
            "KV-event batches from a server's publisher, live or replayed, by result: applied, "
            "restart (a new stream: its blocks dropped first), gap (batches missing before it), "
            "refused (not a batch: docs/kv-events.md#hostile-publishers), late (stamped more "
            "than 5 s ago: not applied)",
            ["server", "result"],
            registry=counted,
        )
        self.replays = Counter(
            "controlplane_picker_kv_replays",
            "Gaps, connections and reconnections asked of a server's replay socket, by result: "
            "filled, failed (after a gap or a reconnection, its blocks dropped)",
            ["server", "result"],
            registry=counted,
        )
        self.lost = Counter(
            "controlplane_picker_kv_streams_lost",
            "A server's blocks dropped rather than trusted, by reason: gap (not replayed), "
            "reconnect (its publisher connected again), removed (no longer in the fleet), late "
            "(a batch came more than 5 s after its stamp: the subscription fell behind)",
            ["server", "reason"],
            registry=counted,
        )
        self.throttled = Counter(
            "controlplane_picker_kv_throttled_seconds",
            "Seconds the KV-event subscriptions stopped reading to keep to their CPU budget (the "
            "index's process: --kv-index-cpu; with --kv-in-process: 30% of the picker's loop): "
            "while they do, the publishers' messages queue, and past limits.KV_EVENT_LAG_MAX_S "
            "are dropped",
            registry=counted,
        )
        self.lag = Gauge(
            "controlplane_picker_kv_event_lag_seconds",
            "Seconds from a server stamping its last KV-event batch to the picker applying it",
            ["server"],
            registry=counted,
        )
        self.connected = Gauge(
            "controlplane_picker_kv_publishers_connected",
            "Servers whose KV-event publisher the picker's subscription has reached (of those "
            "the control plane names): events a server publishes before it is reached are lost",
            registry=counted,
        )
        self.blocks = Gauge(
            "controlplane_picker_kv_index_blocks",
            "Blocks in the precise prefix index, every server",
            registry=r,
        )
        self.bound = Gauge(
            "controlplane_picker_kv_index_bound_blocks",
            "The most blocks the index keeps (--kv-index-blocks)",
            registry=r,
        )
        self.evicted = Gauge(
            "controlplane_picker_kv_index_evicted_blocks",
            "Blocks dropped for the bound since the picker started",
            registry=r,
        )
        self.matched = Histogram(
            "controlplane_picker_kv_blocks_matched",
            "Cached blocks of a prompt on the server picked (its KV events), per pick with a prompt",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
            registry=r,
        )
        self.stale = Gauge(
            "controlplane_picker_kv_stale_servers",
            "Servers of a cluster that publish KV events but went quiet after picks that should "
            "have made them publish: scored by the approximate index until they publish again",
            ["cluster"],
            registry=r,
        )
        self.tokenizer_errors = Counter(
            "controlplane_picker_kv_tokenizer_errors",
            "Prompts not tokenized because the model's tokenizer directory could not be read",
            registry=r,
        )
        self.stale_picks = Gauge(
            "controlplane_picker_kv_stale_picks",
            "Picks that scored a publishing server by the approximate index (its events stale), "
            "since the picker started",
            registry=r,
        )


def refresh_gauges(state: PickerState, metrics: KvMetrics, now: float) -> None:
    """The index's size and evictions, and each cluster's stale servers, as `state` has them."""
    metrics.blocks.set(state.kv.index_blocks)
    metrics.evicted.set(state.kv.evicted)
    metrics.stale_picks.set(state.kv_stale_picks)
    for cluster, servers in state.clusters.items():
        stale = sum(
            1 for c in servers if c.address in state.kv_publishers and not state.kv_fresh(c.address, now)
        )
        metrics.stale.labels(cluster).set(stale)


class KvSubscriptions:
    """One subscription per publishing server, kept to what the assignments name."""

    def __init__(
        self,
        state: PickerState,
        metrics: KvMetrics,
        clock: Callable[[], float] = time.monotonic,
        *,
        busy_share: float = BUSY_SHARE,
        step_pause_s: float = STEP_PAUSE_S,
        step_blocks: int = STEP_BLOCKS,
    ) -> None:
        if not isinstance(state.kv, KvIndex):
            raise TypeError("KvSubscriptions apply events to an index (kvcache/index.py), not a mirror")
        self.state = state
        self.index: KvIndex = state.kv
        self.metrics = metrics
        self.clock = clock
        self.busy_share = busy_share
        self.step_pause_s = step_pause_s
        self.step_blocks = step_blocks
        self.ctx = zmq.asyncio.Context.instance()
        self.tasks: dict[str, tuple[tuple[str, str | None], asyncio.Task[None]]] = {}
        self._busy, self._window = 0.0, clock()  # loop time on events in this BUSY_WINDOW_S
        self.connected: set[str] = set()  # servers whose publisher has been reached
        self.behind: set[str] = set()  # servers whose queued batches are being skipped (_late)
        self._paused_until = 0.0  # reading stopped for the budget until then (clock)
        metrics.bound.set(state.kv.max_blocks)

    def update(self, publishers: Mapping[str, tuple[str, str | None]]) -> None:
        """Subscribe to `publishers` (server -> its events endpoint and replay socket), and to
        no other: a server gone, or publishing elsewhere, is unsubscribed and its blocks dropped."""
        for server, (where, task) in list(self.tasks.items()):
            if publishers.get(server) != where:
                task.cancel()
                del self.tasks[server]
                self.connected.discard(server)
                self.behind.discard(server)
                self.state.kv.forget(server)
                self.metrics.lost.labels(server, "removed").inc()
        for server, where in publishers.items():
            if server not in self.tasks:
                task = asyncio.get_running_loop().create_task(self._follow(server, *where))
                self.tasks[server] = (where, task)
        self.metrics.connected.set(len(self.connected))

    async def close(self) -> None:
        for _, task in self.tasks.values():
            task.cancel()
        for _, task in self.tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()

    def refresh_gauges(self) -> None:
        refresh_gauges(self.state, self.metrics, self.clock())

    async def _follow(self, server: str, endpoint: str, replay: str | None) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.MAXMSGSIZE, limits.KV_EVENT_MAX_BYTES + 64)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        connects = 0
        try:
            sock.connect(endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await monitor.recv_multipart()
                    connects += 1
                    self.connected.add(server)
                    self.metrics.connected.set(len(self.connected))
                    if connects > 1:  # again: what was sent while away is unknown
                        self.state.kv.forget(server)
                        self.metrics.lost.labels(server, "reconnect").inc()
                        log.info("kv events publisher connected again: its blocks dropped", server=server)
                    if replay is not None:
                        # What its replay buffer still holds, from its start: the blocks it
                        # stored before this subscription (a picker or an index process just
                        # started) or while it was away (a reconnect).
                        filled = await self._replay(server, replay, 0, None)
                        self.metrics.replays.labels(server, "filled" if filled else "failed").inc()
                if sock not in ready:
                    continue
                frames = await sock.recv_multipart()
                queued = bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)  # more read already
                await self._take(server, frames, replay, queued)
                await self._budget()
        finally:
            sock.close(linger=0)
            monitor.close(linger=0)

    async def _take(self, server: str, frames: list[bytes], replay: str | None, queued: bool = False) -> None:
        t0 = self.clock()
        try:
            batch = wire.read(frames)
        except wire.WireError as e:
            self._busy += self.clock() - t0
            self.metrics.batches.labels(server, "refused").inc()
            log.debug("kv events batch refused", server=server, reason=str(e)[:200])
            return
        self._busy += self.clock() - t0
        lag = time.time() - batch.ts
        if lag > limits.KV_EVENT_LAG_MAX_S or (server in self.behind and queued):
            self._late(server, lag)
            return
        self.behind.discard(server)  # caught up: this batch starts its stream again
        result = await self._apply(server, batch)
        if result == "gap":
            st = self.index.stream(server)
            start = (st.seq or 0) + 1
            filled = replay is not None and await self._replay(server, replay, start, batch.seq)
            self.metrics.replays.labels(server, "filled" if filled else "failed").inc()
            if not filled:
                self.state.kv.forget(server)
                self.metrics.lost.labels(server, "gap").inc()
            result = await self._apply(server, batch)
        self.metrics.batches.labels(server, result).inc()
        log.debug("kv events batch", server=server, seq=batch.seq, result=result, events=len(batch.events))
        self.metrics.lag.labels(server).set(max(0.0, time.time() - batch.ts))

    def _late(self, server: str, lag: float) -> None:
        """A batch read too late (stamped more than limits.KV_EVENT_LAG_MAX_S ago: the
        subscription fell that far behind its publisher, a flood past its budget), or read while
        the messages queued behind it are skipped: not applied. The server's blocks are dropped
        rather than trusted, once; its messages are then read and skipped (a decode each, no
        keying) until none is queued, and the first batch in time after that starts its stream
        again. Thus a publisher faster than the budget costs a cycle of indexing and skipping,
        never the picks' CPU, and a skip never stops half-way through a backlog to index one
        batch and drop it again."""
        self.metrics.batches.labels(server, "late").inc()
        self.metrics.lag.labels(server).set(max(0.0, lag))
        if server not in self.behind:
            self.behind.add(server)
            self.state.kv.forget(server)
            self.metrics.lost.labels(server, "late").inc()
            log.info("kv events late: the server's blocks dropped", server=server, lag_s=round(lag, 3))

    def _paused(self, now: float, due: float) -> None:
        """Count the wall time every subscription's reading is stopped (several waiting out the
        same budget at once: counted once)."""
        until = now + due
        if until > self._paused_until:
            self.metrics.throttled.inc(until - max(now, self._paused_until))
            self._paused_until = until

    async def _budget(self) -> None:
        """Observation never starves serving: past BUSY_SHARE of the loop's time in this window
        (every subscription's work counted together), wait for the window to pass."""
        now = self.clock()
        if now - self._window >= BUSY_WINDOW_S:
            self._busy, self._window = 0.0, now
        elif self._busy > self.busy_share * BUSY_WINDOW_S:
            due = self._window + self._busy / self.busy_share - now
            self._paused(now, due)
            await asyncio.sleep(due)
        else:
            await asyncio.sleep(self.step_pause_s)

    async def _apply(self, server: str, batch: wire.Batch) -> str:
        """Apply a batch a step at a time (KvIndex.apply_steps), letting the picks run between,
        within the budget."""
        steps = self.state.kv_event_steps(server, batch, self.clock(), self.step_blocks)
        while True:
            t0 = self.clock()
            try:
                next(steps)
            except StopIteration as done:
                self._busy += self.clock() - t0
                return str(done.value.value)
            self._busy += self.clock() - t0
            await self._budget()

    async def _replay(self, server: str, endpoint: str, start: int, upto: int | None) -> bool:
        """Ask `endpoint` for batches `start`..`upto - 1` (None: all it has from `start`, the
        first of them a new stream) and apply them; True if every one came."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, limits.KV_EVENT_MAX_BYTES + 64)
        got: list[wire.Batch] = []
        try:
            sock.connect(endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = self.clock() + REPLAY_TIMEOUT_S
            while upto is None or len(got) <= upto - start + 1:
                left = deadline - self.clock()
                if left <= 0 or not await sock.poll(int(left * 1000)):
                    return False
                seq, payload = wire.replayed(await sock.recv_multipart())
                if seq == wire.END_SEQ:
                    break
                if start <= seq and (upto is None or seq < upto):
                    got.append(wire.read_payload(seq, payload))
                if len(got) > limits.KV_REPLAY_MAX_BATCHES:
                    return False
        except (wire.WireError, zmq.ZMQError):
            return False
        finally:
            sock.close(linger=0)
        got.sort(key=lambda b: b.seq)
        seqs = [b.seq for b in got]
        if upto is None:
            if seqs != list(range(seqs[0], seqs[0] + len(seqs))) if seqs else False:
                return False
        elif seqs != list(range(start, upto)):
            return False  # the replay no longer reaches back, or skipped some
        for b in got:
            # Counted as live batches are: a server whose events all came by replay (stored
            # before this subscription reached it) shows its batches applied.
            self.metrics.batches.labels(server, await self._apply(server, b)).inc()
        self.index.replayed(server)
        return True
