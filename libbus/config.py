"""One settings object, built once at the entry point from defaults, a TOML file, ``BATCHBUS_*``
environment variables, systemd credentials and flags (later wins), then passed down. Library code
never reads the environment; :func:`load_settings` is the only place that does.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libbus import constants as C
from libbus.errors import ConfigError
from libbus.security.auth import ALGORITHMS

__all__ = ["ScriptConnection", "Settings", "load_settings", "default_state_dir", "host_id", "script_connection"]

ENV_PREFIX = "BATCHBUS_"
#: systemd credentials (``LoadCredential=ID:...``) read from ``$CREDENTIALS_DIRECTORY``, by ID: the
#: setting each one provides. ``token`` is the file's text; a ``NAME.key_secret`` is the CURVE key.
CREDENTIALS = {"secret": "secret_file", "token": "token", "token.pub": "public_key_file"}
CURVE_KEY_SUFFIX = ".key_secret"


def default_state_dir(env: Mapping[str, str]) -> str:
    """``$XDG_STATE_HOME/batchbus``, else ``~/.local/state/batchbus`` (systemd units set their own)."""
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "batchbus")


def host_id() -> str:
    """A stable id for this machine: peers with equal host ids may share memory."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value:
            return value
    return socket.gethostname()


@dataclass
class Settings:
    """Every tunable of every service. ``busctl config show`` prints them with their sources."""

    #: The cluster name; tokens carry it as their audience.
    cluster: str = "batchbus"
    #: Where services and admin commands reach the router.
    router: str = "tcp://127.0.0.1:5555"
    #: Where this service binds (router: its control socket; provider: its data socket).
    bind: str = ""
    #: The data endpoint a provider tells trainers to connect to (default: what it bound). A trainer:
    #: the host the other ranks of its gang reach it at (default: its address on the route to the router).
    advertise: str = ""
    #: State directory: secret, router database, checkpoints.
    state_dir: str = ""
    #: Shared HS256 secret; default ``<state_dir>/secret``.
    secret_file: str = ""
    #: A ready-made token (admin commands and services use it instead of minting one from the secret).
    token: str = ""
    #: A file holding the token (read when ``token`` is unset): unlike ``--token`` it never shows in ``ps``.
    token_file: str = ""
    #: Token algorithm of the cluster: EdDSA (the administrator's signing key; nodes hold the public key
    #: and their own token) or HS256 (one shared secret_file that mints any role: a single trusted
    #: machine). Unset: EdDSA, unless this node has the HS256 secret_file and no EdDSA key (a cluster set
    #: up with ``busctl token secret``); ``busctl config show`` says which and why.
    #: Verification accepts only this one.
    token_alg: str = ""
    #: EdDSA: the public key every node verifies tokens with; default ``<state_dir>/token.pub``.
    public_key_file: str = ""
    #: EdDSA: the signing key (administrator's machine only); default ``<state_dir>/token.key``.
    signing_key_file: str = ""
    #: The ``iss`` claim tokens carry and nodes require; default: the cluster name.
    token_issuer: str = ""
    #: Router job database; default ``<state_dir>/router.db``.
    db: str = ""
    #: This service's name in registrations and tokens; default ``<role>-<hostname>-<pid>``.
    name: str = ""
    #: Provider datasets as ``NAME=URI`` strings.
    datasets: list = field(default_factory=list)
    #: Lifetime of tokens minted from the secret.
    token_ttl_s: float = 24 * 3600.0
    heartbeat_ms: int = C.HEARTBEAT_MS
    heartbeat_liveness: int = C.HEARTBEAT_LIVENESS
    request_timeout_s: float = C.REQUEST_TIMEOUT_S
    request_retries: int = C.REQUEST_RETRIES
    max_msg_bytes: int = C.MAX_MSG_BYTES
    hwm: int = C.HWM
    #: Trainer: batch requests kept in flight per loader (0: the loader sizes it, ``RemoteLoader(inflight=None)``:
    #: 4, grown for a dataset read over the network; docs/python-api.md).
    inflight: int = 0
    #: Trainer: connections per loader to each provider on another host (0: 1 for batches under 4 MiB,
    #: else 2; at most ``inflight``); a same-host provider keeps one (docs/python-api.md, flows).
    flows: int = 0
    #: This machine's id; peers with equal ids share memory. Default: /etc/machine-id.
    host_id: str = ""
    #: Trainer: same-host batches through a shared-memory ring instead of the socket.
    shm: bool = True
    #: Trainer: ring slots per loader (0 = inflight + 2: every request in flight, the batch in use and the one before).
    shm_slots: int = 0
    #: Router: where it keeps the final model each succeeded job's trainer sent; default
    #: ``<state_dir>/artifacts`` (``busctl job model`` downloads from here).
    artifact_dir: str = ""
    #: Router: how long a trainer holds a job without being heard from (0: 2 × heartbeat × liveness).
    lease_s: float = 0.0
    #: Trainer: where checkpoints and final models are written; default ``<state_dir>/checkpoints``.
    #: Share it between trainers (NFS...) for a job to resume on another machine.
    checkpoint_dir: str = ""
    #: Trainer: write, per job, the digest of every sample trained on to ``<audit_dir>/<job>.*.jsonl``
    #: (for tests and audits of exactly-once delivery); empty = off.
    audit_dir: str = ""
    #: Trainer: write each job's metrics (per-step loss, progress reports, stall split, epoch records) as
    #: TensorBoard event files under ``<tensorboard_dir>/<job>`` (a study's trial ``<STUDY>/trial-N``); empty = off.
    tensorboard_dir: str = ""
    #: Trainer: with no provider of the dataset answering, seconds to wait for one to come back.
    provider_wait_s: float = C.PROVIDER_WAIT_S
    #: Trainer: seconds between progress reports.
    progress_interval_s: float = C.PROGRESS_INTERVAL_S
    #: Trainer: torch intra-op threads of its jobs' attempts (0 = torch's default, one per core).
    torch_threads: int = 0
    #: Prometheus ``/metrics`` endpoint as HOST:PORT (port 0: any free port); empty = no metrics.
    metrics_bind: str = ""
    #: Services and read helpers: once started, collect garbage and freeze what is left (``gc.freeze``), so that
    #: no later collection walks it (docs/operations.md, "Garbage collection"). Off: for a before-and-after.
    gc_freeze: bool = True
    #: CurveZMQ encryption and key authentication on every socket (docs/security.md).
    curve: bool = False
    #: This node's CURVE key pair (a ``NAME.key_secret`` file); default
    #: ``<state_dir>/curve/<role>.key_secret``. With CURVE on, the service is named after the key.
    curve_key_file: str = ""
    #: The router's CURVE public key (``router.key``); default ``<state_dir>/curve/router.key``.
    curve_router_key: str = ""
    #: Servers: the directory of client public keys (``*.key``) admitted; default
    #: ``<state_dir>/curve/authorized``.
    curve_authorized_dir: str = ""
    #: Provider: serve trainers only the datasets of jobs the router assigned them (or that their
    #: token's ``datasets`` scope names). Off: any trainer token reads train/val.
    assigned_only: bool = True
    #: Per session: most requests being worked on at once; more get RATE_LIMITED.
    session_inflight: int = C.SESSION_INFLIGHT
    #: Per session: sustained requests per second (a token bucket; 0 = no limit) and its burst.
    session_rate: float = C.SESSION_RATE
    session_burst: int = C.SESSION_BURST
    #: Per subject: most sessions open at once on a service; more are refused at Hello.
    sessions_per_subject: int = C.SESSIONS_PER_SUBJECT
    #: Per connection: most bytes of replies held that the peer has not read (0 = no cap), and how
    #: long its next request waits for them to drain before RATE_LIMITED (libbus/serve/backlog.py).
    session_unsent_bytes: int = C.SESSION_UNSENT_BYTES
    unsent_wait_s: float = C.UNSENT_WAIT_S
    #: Without CURVE, services admit a connection only if its handshake carries a valid token, and
    #: clients present theirs (memory stays bounded before authentication). Every node must agree.
    handshake_auth: bool = True
    #: Provider evaluations: most queued or running, largest weights, per minute per job and subject.
    eval_queue: int = C.EVAL_QUEUE
    eval_max_model_bytes: int = C.EVAL_MAX_MODEL_BYTES
    eval_per_minute: float = C.EVAL_PER_MINUTE
    #: Provider: evaluations per day per dataset, all askers together (0 = unlimited), the longest one
    #: may run, and the noise of released test scores (docs/security.md, "The private test split").
    eval_per_dataset_day: int = C.EVAL_PER_DATASET_DAY
    eval_timeout_s: float = C.EVAL_TIMEOUT_S
    eval_epsilon: float = C.EVAL_EPSILON
    #: Files a ``file://`` dataset may name outside its directory (its ``dataset.toml`` entries,
    #: symlinks): these paths and what is under them. Empty: none.
    allowed_paths: list = field(default_factory=list)
    #: Origins (scheme://host[:port]) an HTTP dataset may be redirected to, or name in its manifest,
    #: besides its own. Empty: only its own.
    allowed_origins: list = field(default_factory=list)
    #: Provider: the disk cache of object-store datasets (s3://, gs://, az://): its directory (several
    #: providers may share one) and the most bytes it holds, least recently used evicted. Empty: none.
    cache_dir: str = ""
    cache_limit: int = 0
    #: Provider: threads per dataset that fill same-host ring slots of local data (0: one per core), where
    #: the machine has four cores or more (on fewer, those fills stay on the serving loop: cheaper there).
    fill_threads: int = 0
    #: Provider: batches of one remote dataset (``http(s)://``, an object store) read at once, off the
    #: serving loop on the dataset's own threads, so a slow store delays no other dataset.
    remote_reads: int = C.REMOTE_READS
    #: Provider: read each remote dataset's batches in a helper process of the provider's own when it
    #: shares the provider with another dataset, so its reads take no turns at the serving loop's GIL
    #: (services/provider/read_helper.py). Off: on the provider's threads.
    remote_helper: bool = True
    #: Provider: the decoded-sample cache pipelines share (samples as they leave their stages before the
    #: first random one; docs/datasets.md §7.7): the most bytes it keeps in RAM, least recently used out,
    #: and of its disk tier under ``<state_dir>/decode-cache/<name>``. 0: off (the default: it pays when
    #: it holds most of a dataset that several jobs read, a size only the operator knows).
    decode_cache_bytes: int = 0
    decode_cache_disk_bytes: int = 0
    #: Provider: the Python modules (exact names) whose functions pipeline ``user`` stages may run
    #: (services/provider/sources/pipeline/user_stage.py). Empty: none.
    user_modules: list = field(default_factory=list)
    #: Provider: the modules (exact names, or packages as ``pkg.`` / ``pkg.*``) whose evaluators may score a
    #: model on its test split (``Evaluate`` with ``model.evaluator``; services/provider/evaluator.py).
    #: Empty: built-in models only.
    evaluator_modules: list = field(default_factory=list)
    #: Trainer: the modules whose code jobs may run here, entrypoints and ``module:factory`` models
    #: (exact names, or packages as ``pkg.`` / ``pkg.*``; services/usercode.py). A job never decides
    #: what a node imports. Empty: only the built-in models and entrypoints.
    job_modules: list = field(default_factory=list)
    #: Trainer: an entrypoint attempt (a child process) that makes no job call (step, report,
    #: checkpoint) and fetches no batch for this long is hung: it is killed and the attempt fails.
    attempt_silence_s: float = 300.0
    #: Trainer: how long a stopped or handed-back attempt has to checkpoint and end before it is killed.
    stop_grace_s: float = 30.0
    #: Trainer: the most bytes of an attempt's output (stdout and stderr) kept for ``busctl job logs``
    #: (the last ones; earlier lines are dropped with a marker).
    attempt_log_bytes: int = 256 << 10
    #: Trainer run as root: the user its attempts run as (its uid and group, no supplementary groups), out
    #: of reach of the trainer's token, other jobs' checkpoint folders and co-located services' files
    #: (services/trainer/attempt_user.py). Empty: attempts run as the trainer's own user.
    attempt_user: str = ""
    log_level: str = "INFO"

    def resolved(self) -> Settings:
        """Fill the defaults that derive from other settings (paths under the state dir)."""
        out = dataclasses.replace(self)
        if not out.state_dir:
            raise ConfigError("state_dir is empty")
        if not out.secret_file:
            out.secret_file = os.path.join(out.state_dir, "secret")
        if not out.public_key_file:
            out.public_key_file = os.path.join(out.state_dir, "token.pub")
        if not out.signing_key_file:
            out.signing_key_file = os.path.join(out.state_dir, "token.key")
        if not out.token_issuer:
            out.token_issuer = out.cluster
        if not out.token_alg:
            out.token_alg = "HS256" if _hs256_chosen(out) else "EdDSA"
        if out.token_file and not out.token:
            try:
                out.token = Path(out.token_file).read_text().strip()
            except (OSError, UnicodeDecodeError) as err:
                raise ConfigError(f"token_file {out.token_file}: {err}") from err
            if not out.token:
                raise ConfigError(
                    f"token_file {out.token_file} is empty; it should hold a token ('busctl token issue')"
                )
        if not out.db:
            out.db = os.path.join(out.state_dir, "router.db")
        curve_dir = os.path.join(out.state_dir, "curve")
        if not out.curve_router_key:
            out.curve_router_key = os.path.join(curve_dir, "router.key")
        if not out.curve_authorized_dir:
            out.curve_authorized_dir = os.path.join(curve_dir, "authorized")
        if not out.artifact_dir:
            out.artifact_dir = os.path.join(out.state_dir, "artifacts")
        if not out.checkpoint_dir:
            out.checkpoint_dir = os.path.join(out.state_dir, "checkpoints")
        if out.lease_s <= 0:
            out.lease_s = out.heartbeat_ms / 1000 * out.heartbeat_liveness * 2
        if not out.host_id:
            out.host_id = host_id()
        return out

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def redacted(self) -> dict[str, Any]:
        """:meth:`as_dict` with the token hidden: what ``busctl config show`` prints."""
        out = self.as_dict()
        if out.get("token"):
            out["token"] = f"<hidden: {len(out['token'])} characters>"
        return out


def _hs256_chosen(settings: Settings) -> bool:
    """Whether a node whose ``token_alg`` is unset runs HS256: it holds the cluster secret file (made by
    ``busctl token secret``, the explicit choice of a shared-secret cluster) and no EdDSA key. Else
    EdDSA, the default set-up: no secret anywhere, so no node but the administrator's can mint."""
    if not os.path.exists(settings.secret_file):
        return False
    return not (os.path.exists(settings.public_key_file) or os.path.exists(settings.signing_key_file))


def _credentials(directory: str) -> dict[str, tuple[str, str]]:
    """The settings systemd credentials in ``directory`` provide: ``{setting: (value, credential id)}``.

    Raises :class:`ConfigError` for an unreadable directory, an empty token or two CURVE keys.
    """
    try:
        names = sorted(os.listdir(directory))
    except OSError as err:
        raise ConfigError(f"CREDENTIALS_DIRECTORY={directory}: {err.strerror}") from err
    found: dict[str, tuple[str, str]] = {}
    for cred, name in CREDENTIALS.items():
        if cred not in names:
            continue
        path = os.path.join(directory, cred)
        if name != "token":
            found[name] = (path, cred)
            continue
        try:
            token = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"credential {path}: {err}") from err
        if not token:
            raise ConfigError(f"credential {path} is empty; it should hold a token ('busctl token issue')")
        found[name] = (token, cred)
    keys = [n for n in names if n.endswith(CURVE_KEY_SUFFIX)]
    if len(keys) > 1:
        raise ConfigError(f"credentials {', '.join(keys)} in {directory}: give a service one CURVE key")
    if keys:
        found["curve_key_file"] = (os.path.join(directory, keys[0]), keys[0])
    return found


def _coerce(name: str, kind: type, value: Any, source: str) -> Any:
    if kind is list:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list):
            return [str(v) for v in value]
    elif kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
    elif kind in (int, float):
        if isinstance(value, bool):
            pass
        elif isinstance(value, (int, float)) or isinstance(value, str):
            try:
                return kind(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{source}: '{name}' must be {kind.__name__}, got {value!r}")


def load_settings(
    *, config_file: str | None = None, env: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None
) -> tuple[Settings, dict[str, str]]:
    """Build the settings: defaults < TOML file < ``BATCHBUS_*`` environment < systemd credentials < flags.

    ``config_file`` defaults to ``$BATCHBUS_CONFIG`` when set. Flags whose value is ``None`` are unset.
    Under systemd, files the unit passes with ``LoadCredential=`` (``$CREDENTIALS_DIRECTORY``) set
    ``secret_file`` (credential ``secret``), ``token`` (``token``, its text) and ``curve_key_file``
    (``NAME.key_secret``): a unit's ``Environment=`` paths are then only the fallback when the
    credential was not provisioned.
    Returns the settings (derived paths filled in) and, per field, where its value came from.
    Raises :class:`ConfigError` naming the file, variable or flag that is wrong.
    """
    env = dict(os.environ if env is None else env)
    types_ = typing.get_type_hints(Settings)
    values: dict[str, Any] = {}
    sources = {name: "default" for name in types_}

    config_file = config_file or env.get(ENV_PREFIX + "CONFIG")
    if config_file:
        try:
            with open(config_file, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError as err:
            raise ConfigError(f"config file {config_file} does not exist") from err
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {config_file} is not valid TOML: {err}") from err
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in types_:
                raise ConfigError(f"{config_file}: unknown setting '{key}'; known: {', '.join(sorted(types_))}")
            values[name] = _coerce(name, types_[name], value, config_file)
            sources[name] = f"file {config_file}"
    for name, kind in types_.items():
        var = ENV_PREFIX + name.upper()
        if var in env and env[var] != "":
            values[name] = _coerce(name, kind, env[var], f"environment {var}")
            sources[name] = f"env {var}"
    if env.get("CREDENTIALS_DIRECTORY"):
        for name, (value, cred) in _credentials(env["CREDENTIALS_DIRECTORY"]).items():
            values[name] = value
            sources[name] = f"credential {cred}"
    for key, value in (flags or {}).items():
        if value is None:
            continue
        name = key.replace("-", "_")
        if name not in types_:
            raise ConfigError(f"unknown setting '{key}'")
        values[name] = _coerce(name, types_[name], value, f"--{name.replace('_', '-')}")
        sources[name] = "flag"
    if not values.get("state_dir"):
        values["state_dir"] = default_state_dir(env)
    settings = Settings(**values)
    if settings.token_alg and settings.token_alg not in ALGORITHMS:
        raise ConfigError(
            f"token_alg ({sources['token_alg']}) must be one of {', '.join(ALGORITHMS)}, got {settings.token_alg!r}"
        )
    if settings.heartbeat_ms <= 0 or settings.heartbeat_liveness <= 0:
        raise ConfigError("heartbeat_ms and heartbeat_liveness must be positive")
    if settings.session_inflight < 1 or settings.session_rate < 0 or settings.session_burst < 1:
        raise ConfigError("session_inflight and session_burst must be at least 1, session_rate not negative")
    if settings.provider_wait_s < 0:
        raise ConfigError(
            f"provider_wait_s ({sources['provider_wait_s']}) must not be negative, got {settings.provider_wait_s}"
        )
    if settings.request_timeout_s <= 0 or settings.request_retries < 0:
        raise ConfigError("request_timeout_s must be positive and request_retries not negative")
    if settings.inflight < 0:
        raise ConfigError(
            f"inflight ({sources.get('inflight', 'default')}) must be 0 (the loader sizes it) or more, got {settings.inflight}"
        )
    inflight = settings.inflight or C.LOADER_INFLIGHT
    if not 0 <= settings.flows <= inflight:
        raise ConfigError(
            f"flows ({sources['flows']}) must be 0 (from the batch size) up to inflight ({inflight}), "
            f"got {settings.flows}"
        )
    _check_cache(settings, sources)
    if settings.fill_threads < 0 or settings.remote_reads < 1:
        raise ConfigError(
            f"fill_threads ({sources['fill_threads']}) must be 0 (one per core) or more, and remote_reads "
            f"({sources['remote_reads']}) at least 1; got {settings.fill_threads} and {settings.remote_reads}"
        )
    for name in ("decode_cache_bytes", "decode_cache_disk_bytes"):
        if getattr(settings, name) < 0:
            raise ConfigError(
                f"{name} ({sources[name]}) must be a number of bytes, not negative, got {getattr(settings, name)}"
            )
    resolved = settings.resolved()
    if not settings.token_alg:
        why = f"the secret file {resolved.secret_file} is here" if resolved.token_alg == "HS256" else "no secret file"
        sources["token_alg"] = f"default ({why})"
    return resolved, sources


def _check_cache(settings: Settings, sources: dict[str, str]) -> None:
    """The object-store disk cache: a limit in bytes, not negative, that a cache directory needs, and a
    directory (or a path one can be made at), not a file."""
    if settings.cache_limit < 0:
        raise ConfigError(
            f"cache_limit ({sources['cache_limit']}) must be a number of bytes, not negative, got {settings.cache_limit}"
        )
    where = settings.cache_dir
    if where and os.path.exists(where) and not os.path.isdir(where):
        raise ConfigError(f"cache_dir ({sources['cache_dir']}) {where} is a file, not a directory")
    if where and settings.cache_limit == 0:
        raise ConfigError(
            f"cache_dir ({sources['cache_dir']}) needs a cache_limit in bytes (--cache-limit, "
            "BATCHBUS_CACHE_LIMIT), e.g. 100000000000"
        )


@dataclass(frozen=True)
class ScriptConnection:
    """Where a training script's loader connects when it names no router: the router, token and
    CURVE files ``busctl`` would use (:func:`script_connection`)."""

    router: str
    #: The token, or "" when none is configured.
    token: str
    #: With ``curve`` on: this client's key pair file and the router's public key file; else "".
    curve_key_file: str = ""
    curve_router_key: str = ""


def script_connection(role: str = "trainer", env: Mapping[str, str] | None = None) -> ScriptConnection:
    """The connection settings of a script, from the same places as ``busctl``'s: defaults < the TOML
    file ``$BATCHBUS_CONFIG`` < ``BATCHBUS_*`` variables (``BATCHBUS_ROUTER``, ``BATCHBUS_TOKEN``,
    ``BATCHBUS_TOKEN_FILE``...) < systemd credentials. ``role`` names the default CURVE key file.
    A script's token should be a reader token (``busctl token issue --role reader --dataset NAME``):
    it reads its datasets and can take no job, report no score and push no weights.

    Raises:
        ConfigError: as :func:`load_settings`, naming the file or variable that is wrong.
    """
    settings, _ = load_settings(env=env)
    if not settings.curve:
        return ScriptConnection(router=settings.router, token=settings.token)
    key_file = settings.curve_key_file or os.path.join(settings.state_dir, "curve", f"{role}.key_secret")
    return ScriptConnection(
        router=settings.router,
        token=settings.token,
        curve_key_file=key_file,
        curve_router_key=settings.curve_router_key,
    )
