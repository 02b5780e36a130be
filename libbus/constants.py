"""Named limits and timeouts, in one place. Settings can override the ones users tune."""

#: The wire tag, ``BB`` + the wire version. 2: batches carry named fields.
PROTOCOL = b"BB2"
#: This build's version, sent in ``Hello``.
VERSION = "0.1.0"

KiB = 1024
MiB = 1024 * KiB

#: Payload frames at least this large are sent zero-copy (``copy=False``); smaller ones are cheaper copied.
ZERO_COPY_THRESHOLD = 64 * KiB
#: Default ZMQ_MAXMSGSIZE: a single frame larger than this disconnects the sender.
MAX_MSG_BYTES = 256 * MiB
#: Default send/receive high-water marks (messages).
HWM = 1000
#: Most frames in one message; more is a malformed message.
MAX_FRAMES = 16
#: Largest JSON header accepted.
MAX_HEADER_BYTES = 1 * MiB
#: Deepest nesting of containers a header may have (orjson writes at most 254 levels).
MAX_HEADER_DEPTH = 32
#: Peer JSON a service stores or echoes (heartbeat stats, provider caps, progress, results, checkpoints,
#: acknowledgements): deepest nesting and largest encoding accepted. Admin replies nest these a few
#: levels deeper, well inside MAX_HEADER_DEPTH.
STORED_JSON_DEPTH = 12
STORED_JSON_BYTES = 256 * KiB
#: Most indices in one BatchRequest.
MAX_BATCH_INDICES = 1 << 20
#: Most indices in one LocateSamples (its reply is one header of a short string per index).
MAX_LOCATE_INDICES = 10_000
#: Largest batch a provider will assemble (data + labels); below MAX_MSG_BYTES so a reply always fits.
MAX_BATCH_BYTES = 128 * MiB
#: Most samples in a batch of named fields of which one declares no ``max_bytes`` (its size is known
#: only once read): a bound before the read, as MAX_BATCH_BYTES is for every other batch.
MAX_UNDECLARED_BATCH = 1 << 16

#: Per session: most requests a service works on at once (a loader keeps ``inflight`` ≤ this).
SESSION_INFLIGHT = 64
#: Loader: batch requests in flight at first (and for a dataset on its provider's disk; libbus/loader/window_size.py).
LOADER_INFLIGHT = 4
#: Provider: batches of one remote dataset read at once (``remote_reads``; services/provider/fillers.py).
REMOTE_READS = 8
#: Per session: sustained requests per second and burst (token bucket). Generous: a loader at
#: 300k samples/s with batches of 256 sends ~1,200 requests/s.
SESSION_RATE = 5000.0
SESSION_BURST = 2000
#: Per token subject: most sessions open at once on one service (admin scripts, loaders).
SESSIONS_PER_SUBJECT = 64
#: Per connection: most bytes of replies a service holds that the peer has not taken yet (libbus/
#: backlog.py); past it the connection's requests wait, and after UNSENT_WAIT_S are refused.
SESSION_UNSENT_BYTES = 64 * MiB
UNSENT_WAIT_S = 30.0
#: Replies at least this large are tracked until they leave the process; smaller ones are bounded
#: by the high-water mark (HWM x this). Tracking a reply with no zero-copy frame costs one.
TRACK_MIN_BYTES = 16 * KiB

#: How often peers exchange heartbeats, and how many missed intervals drop a peer.
HEARTBEAT_MS = 1000
HEARTBEAT_LIVENESS = 5

#: Client defaults: how long to wait for one reply, and how many times to resend before giving up.
REQUEST_TIMEOUT_S = 10.0
REQUEST_RETRIES = 2
#: Time to wait for a Welcome after Hello.
HELLO_TIMEOUT_S = 5.0
#: Service poll period when nothing happens: bounds how long a stop request waits.
POLL_MS = 100
#: Longest a server handles one burst of requests before it flushes and sends their replies.
BURST_S = 0.02
#: How long a draining service waits for in-flight work after SIGTERM.
DRAIN_S = 5.0
#: How long the replies a draining service sent get to leave before its socket closes.
DRAIN_LINGER_S = 1.0
#: A trainer with no task asks again after this long.
TASK_POLL_S = 1.0
#: How often a trainer reports progress.
PROGRESS_INTERVAL_S = 2.0
#: Loader: how long to wait for a provider of the dataset to come back when none answers.
PROVIDER_WAIT_S = 60.0
#: Loader: pause between rounds of looking for a provider while none answers.
PROVIDER_RETRY_S = 0.5

#: Provider evaluations (Evaluate): most queued or running at once, largest weights frame, and how
#: many per minute per job and per token subject (they score the private test split).
EVAL_QUEUE = 4
EVAL_MAX_MODEL_BYTES = 128 * MiB
EVAL_PER_MINUTE = 10.0
#: ... and how many per day per dataset, whoever asks (docs/security.md: the test split's leakage bound).
EVAL_PER_DATASET_DAY = 200
#: Longest one evaluation may run on the provider (the trainer waits EVALUATE_TIMEOUT_S = 300 s).
EVAL_TIMEOUT_S = 240.0
#: Scores of a private test split are released rounded to this step, with Laplace noise of scale
#: sensitivity / (n * EVAL_EPSILON) per metric (0: exact, for a split that needs no hiding).
EVAL_QUANTUM = 1e-3
EVAL_EPSILON = 0.1
#: A prediction's cross-entropy counts at most this much in a released test loss (bounds what one
#: sample can move it; a diverged model's NaN counts as this).
EVAL_LOSS_CLIP = 10.0
