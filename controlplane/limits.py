"""Bounds on what the control plane accepts, in one place (docs/limits.md lists them).

Every input class takes its bounds from here: the fleet file (loader), and, as they are
hardened, the metrics reader, the operator API and the xDS server. A value outside a bound
gets a precise error naming the field and the bound; nothing is silently clamped here.
"""

from __future__ import annotations

# ---- the fleet file ------------------------------------------------------------------------

FLEET_FILE_MAX_BYTES = 4 << 20  # a fleet of thousands of endpoints is a few hundred KB
FLEET_MAX_NODES = 200_000  # YAML nodes, counting every expansion of an alias
FLEET_MAX_DEPTH = 64  # nesting of mappings and lists

# Durations anywhere in the fleet file: at least a millisecond (Envoy reads 0 as "none"),
# at most 30 days (Envoy's Duration and every timer here stay far from overflow).
DURATION_MIN_S = 0.001
DURATION_MAX_S = 30 * 86400.0

# The signals loop: an interval short enough to burn a core, or so long that a fixed file
# waits for it, is refused; a timeout must leave a scrape time to answer.
SIGNALS_INTERVAL_MIN_S = 0.05
SIGNALS_INTERVAL_MAX_S = 300.0
SIGNALS_TIMEOUT_MIN_S = 0.01

# How long a proxy waits for a per-request pick before routing by the weights: every picked
# request may wait this long while a picker is slow, so a second is the most that makes sense.
PICKER_TIMEOUT_MIN_S = 0.001
PICKER_TIMEOUT_MAX_S = 1.0
# Quotas (fleet `quotas:`): a per-minute limit above this is a typo, not a limit; a proxy
# waits at most this long for a rate-limit decision before it applies on_error.
QUOTA_PER_MINUTE_MAX = 1_000_000_000
QUOTA_TIMEOUT_MIN_S = 0.001
QUOTA_TIMEOUT_MAX_S = 1.0

# A fleet file must hold still this long before a destructive decision taken from it (a
# rollout aborted because a version left the file, the API's layers dropped) is stored.
FILE_SETTLE_S = 2.0
# ...but a file that keeps changing (a tool rewriting it every second) is not held forever:
# held content that was read the same on two polls in a row goes out at most this long after
# the first held change.
FILE_SETTLE_MAX_S = 6.0

# Numbers: finite, and within a range that means something for the key.
PARAMS_B_MAX = 1_000_000.0  # billions of parameters
MEMORY_GB_MAX = 1_000_000.0
CAPACITY_MAX = 1_000.0  # relative throughput

# LoRA adapters one model may name in the fleet file (`adapters:`): each is a route matcher
# entry and a picker's residency entry per server.
FLEET_ADAPTERS_MAX = 1000

# ---- the operator API ----------------------------------------------------------------------

API_NAME_MAX_CHARS = 256  # a model, version or endpoint address in a request
API_REASON_MAX_CHARS = 1024  # an operator's reason, stored in the history

# ---- the status HTTP port ------------------------------------------------------------------

STATUS_HTTP_TIMEOUT_S = 10.0  # a request must arrive whole within this
STATUS_HTTP_MAX_CONNECTIONS = 128  # served at once; more are closed at once

# ---- metrics pages -------------------------------------------------------------------------

METRICS_MAX_SERIES = 20_000  # series of the families read on one page (a real one has < 1,000)
METRICS_MAX_QUEUE = 100_000  # requests running or waiting on one server
# vLLM's LoRA adapters (`vllm:lora_requests_info`, docs/signals.md#lora-adapters): names in
# one list (running or waiting; each name at most API_NAME_MAX_CHARS) and the slots
# (--max-loras) a server may claim. vLLM adds a series for every distinct combination it has
# shown and never removes one, so a long-running server's page grows them: they are bounded
# on their own, not counted in METRICS_MAX_SERIES. Past any of these bounds the adapters are
# unknown; the rest of the page is read as usual.
METRICS_LORA_MAX_ADAPTERS = 64
METRICS_LORA_MAX_SLOTS = 1024
METRICS_LORA_MAX_SERIES = 10_000
# llama.cpp's adapters (`GET /lora-adapters`, docs/signals.md#lora-adapters): the answer's
# size (a list of METRICS_LORA_MAX_ADAPTERS entries is a few KB). Past it, or past
# METRICS_LORA_MAX_ADAPTERS entries, the adapters are unknown.
LLAMACPP_LORA_MAX_BYTES = 1 << 20

# ---- the xDS and LRS port ------------------------------------------------------------------

XDS_MAX_NODE_ID_CHARS = 1024  # a longer node id ends the stream (INVALID_ARGUMENT)
XDS_MAX_NACK_MESSAGE_CHARS = 4096  # a NACK's message as stored, shown and logged (cut beyond)
LRS_MAX_COUNT = 1_000_000  # per endpoint and report (a second): requests issued, done, in flight
XDS_SHARED_NAMES_MAX = 400_000  # names kept for sharing between streams, all subscriptions together
XDS_MAX_NAMES_PER_TYPE = 100_000  # names one stream subscribes to, per resource type
XDS_MAX_NAME_CHARS = 1024  # a subscribed resource name (ours are under 300 characters)
# Subscribed names the snapshot does not have, per stream and type: a proxyless client asking
# for a model not yet in the fleet holds a few; more costs every response for nothing.
XDS_MAX_UNKNOWN_NAMES = 1_000
# Requests read ahead of the protocol on one stream: a client that sends faster than the
# server answers is pushed back by HTTP/2 flow control instead of growing the server.
XDS_INBOX_MAX_REQUESTS = 64
XDS_INBOX_MAX_BYTES = 1 << 20  # one request is always taken, however large (up to 4 MiB)
XDS_MAX_STREAMS_PER_CONNECTION = 16  # an Envoy opens 1-6 (ADS or one per type, and LRS)

# ---- the picker's ports (controlplane picker, docs/picker.md#hostile-input) -----------------

# A prefix key as the gateway's Lua filter sends it: the prompt's first bytes, at most the
# fleet's prefix.max_bytes / prompt_bytes, whose largest allowed value is 1 MiB
# (fleet/schema_models.py). The index keeps a 16-byte digest of it, never the key.
PICKER_PREFIX_KEY_MAX_BYTES = 1 << 20
PICKER_PREFIX_DIGEST_BYTES = 16
# A subset hint (the Endpoint Picker Protocol's): the servers a request may go to.
PICKER_SUBSET_MAX_ADDRESSES = 1024
PICKER_SUBSET_MAX_BYTES = 64 << 10
# The route's cluster as Envoy names it (ours are a model and a version: well under 300).
PICKER_CLUSTER_MAX_CHARS = 1024
# One ext_proc message: Envoy's headers-only messages are a few KB (a 3 MB header is legal).
PICKER_MAX_MESSAGE_BYTES = 4 << 20
# A peer's answer (its requests in flight per server): entries, bytes on the wire, and the
# most one server may hold by its word: its slots (learnt from its page, else the most any
# server showed, else PICKER_PEER_DEFAULT_SLOTS) times PICKER_PEER_SLOTS_FACTOR, and never
# above METRICS_MAX_QUEUE (what a page may show running or waiting on one server).
PICKER_PEER_MAX_SERVERS = 10_000
PICKER_PEER_MAX_BYTES = 1 << 20
PICKER_PEER_SLOTS_FACTOR = 16
PICKER_PEER_DEFAULT_SLOTS = 64

# KV events (kvcache/): one message from a server's publisher (a ZMQ frame, msgpack) is at
# most this long (vLLM's batches are a few KB: a step's blocks), names at most this many
# events and blocks, and a block hash at most this many bytes (vLLM's are 64-bit integers or
# 32-byte digests). A message past a bound is refused whole and counted.
KV_EVENT_MAX_BYTES = 4 << 20
KV_EVENTS_PER_BATCH_MAX = 65_536
KV_BLOCKS_PER_EVENT_MAX = 65_536
KV_BLOCK_SIZE_MAX = 4096  # tokens in one block (vLLM's are 16 to 256)
KV_HASH_MAX_BYTES = 64
KV_REPLAY_MAX_BATCHES = 20_000  # a replay longer than this is refused (vLLM keeps 10,000)
# A live batch stamped longer ago than this (the publisher's clock against ours) is not applied:
# its server's blocks are dropped, as for a gap, and its stream starts again from a batch in time.
KV_EVENT_LAG_MAX_S = 5.0
KV_INDEX_CPU = 0.25  # cores the index's process takes at most (--kv-index-cpu): docs/kv-events.md
# The prompt the gateway hands the picker (controlplane.prompt metadata): at most this much of
# the body; what is past it is not matched (the blocks found are those of its first part).
PICKER_PROMPT_MAX_BYTES = 1 << 20
