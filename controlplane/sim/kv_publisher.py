"""The emulator's KV events, published as vLLM publishes them (kvcache/wire.py's format): a
ZMQ PUB socket bound at the server's `kv_events` endpoint, a ROUTER replay socket at
`kv_replay`, one batch per change of the prefix cache (vLLM batches per engine step: here a
request's admission is the step), sequence numbers from 0 at each start (a restarted server
is a new stream, as a restarted vLLM's), the last REPLAY_KEPT batches kept for replay.

Block hashes are 64-bit integers (vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), the
block size is the prefix cache's (16, vLLM's default); the token ids are the prompt's (the
model's tokenizer where the emulator has one, else a stable id per word); a LoRA adapter's
blocks carry its name (`lora_name`), as vLLM's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from controlplane.kvcache import wire

REPLAY_KEPT = 10_000  # vLLM's buffer_steps default


class KvPublisher:
    def __init__(self, endpoint: str, replay: str | None = None) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay
        self.ctx = zmq.asyncio.Context.instance()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_KEPT)
        self.pub: zmq.asyncio.Socket | None = None
        self.router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.published = 0
        self.drop_next = 0  # test hook: batches numbered but not sent (a gap the subscriber sees)

    def start(self) -> None:
        """Bind (a new stream: sequence numbers from 0)."""
        self.seq = 0
        self.buffer.clear()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind(self.endpoint)
        if self.replay_endpoint:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(self.replay_endpoint)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self.pub, self.router):
            if sock is not None:
                sock.close(linger=0)
        self.pub = self.router = None

    def publish(self, events: Sequence[dict[str, Any]]) -> None:
        if self.pub is None or not events:
            return
        seq = self.seq
        self.seq += 1
        payload = wire.payload(time.time(), events)
        self.buffer.append((seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
            return
        with contextlib.suppress(zmq.Again):
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        self.published += 1

    def stored(
        self,
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        lora: str | None = None,
    ) -> None:
        self.publish([wire.stored(hashes, parent, token_ids, block_size, lora)])

    def removed(self, hashes: Sequence[int]) -> None:
        self.publish([wire.removed(hashes)])

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:  # as vLLM 0.32 answers: (delimiter, topic, seq, payload)
                    await self.router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart(
                [client, b"", b"", wire.END_SEQ.to_bytes(8, "big", signed=True), b""]
            )
