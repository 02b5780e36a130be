"""The router's peers: who is connected, as whom, and who serves which dataset.

A session opens with its ``Hello`` (:meth:`Peers.on_open`: a trainer's or provider's subject held by one
process at a time, a provider's datasets the same as their other replicas', an attempt's grant and a
reader's non-loader session refused) and is indexed by role and subject, and by the datasets it serves,
so that every request's lookup is one step, not a scan over a thousand sessions. ``Resolve`` answers
with a dataset's live providers; ``ListPeers`` lists the sessions an admin's scopes cover. A mixin of
:class:`~.handler.RouterHandler` (what providers are told of grants: :mod:`.grants`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from libbus.errors import BadRequest, Forbidden, NotFound, Unavailable
from libbus.jobs.spec import dataset_name
from libbus.serve.handler import serves
from libbus.serve.server import Session
from libbus.serve.sessions import SessionInfo, reader_info
from libbus.wire.dataset_info import ProviderEntry
from libbus.wire.messages import ListPeers, Message, PeerList, Resolve, Resolved
from libbus.wire.msg_data import info_mismatch

from ..importable import TrainerModules
from .eval_budget import EvalBudget

__all__ = ["RESOLVERS", "PeerRow", "Peers"]

log = logging.getLogger(__name__)

#: Who may resolve a dataset: a reader's loader too (a reader sends nothing else here).
RESOLVERS = ("trainer", "reader", "admin")


class PeerRow(SessionInfo, total=False):
    """A row of ``ListPeers`` (``busctl peers --json``): the session, and for a provider what it serves."""

    #: The provider's data endpoint.
    endpoint: str
    #: Per dataset served, its private test split's evaluations left today (None: unlimited).
    evaluations_left_today: dict[str, int | None]
    #: The datasets served (a scoped admin: those its scopes name).
    datasets: list[str]


class Peers:
    """The router's sessions, for its handler (which provides ``trainer_modules``, ``eval_budget``, the
    server's ``push``, and :mod:`.grants`' ``welcome_provider`` and ``forget_sent``)."""

    trainer_modules: TrainerModules
    eval_budget: EvalBudget
    push: Callable[[str, Message], None]
    welcome_provider: Callable[[Session], None]
    forget_sent: Callable[[str], None]

    def init_peers(self) -> None:
        self.peers: dict[str, Session] = {}
        #: role -> token subject -> session id -> session: the lookups every request makes, without
        #: a scan over a thousand sessions (sessions_of, trainer_session, _check_single_holder).
        self._by_subject: dict[str, dict[str, dict[str, Session]]] = {}
        #: dataset -> provider session id -> session: who serves a dataset, without a scan (Resolve, grants).
        self._serving: dict[str, dict[str, Session]] = {}
        #: Trainer sessions opened and closed; with ``store.changes``, when assignments can have moved.
        self._roster = 0

    def on_open(self, session: Session) -> None:
        if session.role == "attempt":
            raise Forbidden(
                "an attempt's grant reads its job's data and scores its models at providers; the router "
                "takes nothing from it (an attempt reports through its trainer)"
            )
        if session.role == "reader" and not session.loader:
            raise Forbidden(
                "a reader token opens loader sessions only (RemoteLoader says Hello with caps.loader); "
                "a trainer service needs a trainer token (busctl token issue --role trainer)"
            )
        if session.kind in ("trainer", "provider"):
            self._check_single_holder(session)
        if session.kind == "trainer":  # what it can import: refused here when malformed or oversized
            self.trainer_modules.register(session.sid, session.name, session.hello.caps, session.claims.allows_dataset)
        if session.role == "provider":
            caps = session.hello.caps
            endpoint, datasets = caps.get("endpoint"), caps.get("datasets")
            if not isinstance(endpoint, str) or not endpoint:
                raise BadRequest("a provider's Hello must carry caps.endpoint (its data socket)")
            if not isinstance(datasets, dict) or not all(isinstance(v, dict) for v in datasets.values()):
                raise BadRequest("a provider's Hello must carry caps.datasets {name: DatasetInfo}")
            curve_key = caps.get("curve_key", "")
            if not isinstance(curve_key, str) or len(curve_key) not in (0, 40):
                raise BadRequest("a provider's caps.curve_key must be its 40-character z85 public key")
            for dataset in datasets:  # a provider token scoped to datasets serves only those
                session.claims.check_dataset(dataset)
            self._check_replicas(session, datasets)
            log.info("provider %s serves %s at %s", session.name, ", ".join(datasets) or "nothing", endpoint)
        self.peers[session.sid] = session
        self._by_subject.setdefault(session.kind, {}).setdefault(session.subject, {})[session.sid] = session
        self._roster += session.kind == "trainer"
        if session.role == "provider":
            for dataset in session.hello.caps["datasets"]:
                self._serving.setdefault(dataset, {})[session.sid] = session
            self.welcome_provider(session)

    def _check_single_holder(self, session: Session) -> None:
        """Refuse a trainer or provider session whose subject a live session of another process
        holds: two trainers of one identity would own, abandon and train each other's jobs. (A
        loader's session is indexed apart, under ``"loader"``: it never meets this rule.) Host id
        and pid are the peer's word, so the same process proves itself with the nonce its live
        session's Welcome gave it; a restarted process waits for the old session to expire."""
        for peer in self._by_subject.get(session.kind, {}).get(session.subject, {}).values():
            if peer.process == session.process and secrets.compare_digest(peer.nonce, session.hello.nonce):
                session.nonce = peer.nonce  # one secret for all of the process's sessions
                continue
            same = (
                "claims to be that process but does not present its session nonce; "
                if (peer.process == session.process)
                else ""
            )
            raise Unavailable(
                f"{session.role} {session.subject!r} is already connected from host "
                f"{peer.hello.host_id or '?'} pid {peer.hello.pid} (as {peer.name!r}); this Hello {same}one process "
                f"holds an identity at a time: give this {session.role} its own token (busctl token issue --name), "
                "or stop the other one (its session expires after a few silent heartbeats)"
            )

    def _check_replicas(self, session: Session, datasets: dict) -> None:
        """Refuse a provider whose DatasetInfo for a name differs from a live replica's (another
        provider serving that name): a loader spreads one epoch's requests over all replicas."""
        name = session.name
        for peer in self.sessions_of("provider"):
            if peer.subject == session.subject:
                continue  # this provider registering again: its new Hello replaces the old one
            for dataset, info in datasets.items():
                theirs = peer.hello.caps["datasets"].get(dataset)
                why = None if theirs is None else info_mismatch(info, theirs, f"on {name}", f"on {peer.name}")
                if why:
                    raise BadRequest(
                        f"dataset {dataset!r} differs from the replica {peer.name} serves: {why}; "
                        "replicas of a dataset must serve the same data (serve it under "
                        "another name, or fix the source)"
                    )

    def on_close(self, session: Session, reason: str) -> None:
        if self.peers.pop(session.sid, None) is None:
            return
        self.forget_sent(session.sid)
        self.trainer_modules.drop(session.sid)
        self._roster += session.kind == "trainer"
        if session.role == "provider":
            for dataset in session.hello.caps["datasets"]:
                serving = self._serving.get(dataset, {})
                serving.pop(session.sid, None)
                if not serving:
                    self._serving.pop(dataset, None)
        subjects = self._by_subject.get(session.kind, {})
        sessions = subjects.get(session.subject, {})
        sessions.pop(session.sid, None)
        if not sessions:
            subjects.pop(session.subject, None)

    def sessions_of(self, role: str) -> list[Session]:
        return [s for subject in self._by_subject.get(role, {}).values() for s in subject.values()]

    def trainer_session(self, subject: str) -> Session | None:
        """The trainer's live session: the one heard from last (a reconnected trainer's old session
        lingers until it expires, and a push sent there is lost)."""
        sessions = self._by_subject.get("trainer", {}).get(subject, {}).values()
        return max(sessions, key=lambda s: s.last_seen, default=None)

    def _trainer_names(self) -> AbstractSet[str]:
        """The subjects of the connected trainers (a live view: no copy of a thousand names each turn)."""
        return self._by_subject.setdefault("trainer", {}).keys()

    def _push_to_trainer(self, subject: str, msg: Message) -> str:
        """Push to the trainer's live session; its session id, or "" when it is not connected."""
        session = self.trainer_session(subject)
        if session is None:
            return ""
        self.push(session.sid, msg)
        return session.sid

    @serves(Resolve, *RESOLVERS)
    def on_Resolve(self, session: Session, msg: Resolve) -> Resolved:
        name = dataset_name(msg.dataset)
        session.claims.check_dataset(name)
        # One entry per endpoint, from the session heard from last: a provider that reconnected
        # (its router link went silent for a moment) has an old session here until it expires.
        # The order stays the order providers registered in (a trainer and a script resolving
        # at different moments see the same list).
        latest: dict[str, Session] = {}
        for peer in self._serving.get(name, {}).values():
            endpoint = peer.hello.caps["endpoint"]
            if endpoint not in latest or peer.last_seen >= latest[endpoint].last_seen:
                latest[endpoint] = peer  # (a dict keeps the key's first place)
        providers: list[ProviderEntry] = [
            {
                "name": peer.name,
                "endpoint": endpoint,
                "host_id": peer.hello.host_id,
                "curve_key": str(peer.hello.caps.get("curve_key") or ""),
            }
            for endpoint, peer in latest.items()
        ]
        if not providers:
            online = sorted({f"{d} ({p.name})" for p in self.sessions_of("provider") for d in p.hello.caps["datasets"]})
            raise NotFound(
                f"dataset {name!r} is not served by any provider; online: {', '.join(online) or 'no providers'}"
            )
        info = next(iter(latest.values())).hello.caps["datasets"][name]  # the first registered's
        return Resolved(dataset=name, info=dict(reader_info(info, session.claims)), providers=providers)

    def _train_size(self, dataset: str) -> int | None:
        """The train split's size as a live provider of ``dataset`` registered it (None: none online)."""
        for peer in self._serving.get(dataset_name(dataset), {}).values():
            info = peer.hello.caps["datasets"].get(dataset_name(dataset)) or {}
            train = (info.get("splits") or {}).get("train") or {}
            if isinstance(train.get("num_samples"), int):
                return int(train["num_samples"])
        return None

    @serves(ListPeers, "admin")
    def on_ListPeers(self, session: Session, msg: ListPeers) -> PeerList:
        # A scoped admin sees what lies inside its scopes: providers by the datasets its datasets
        # scope names (only those; a scope of jobs alone names none, so it sees no provider), other
        # sessions whose own scopes lie inside its own (as it may revoke them).
        admin, peers = session.claims, []
        named = admin.scopes.get("datasets") if admin.scopes else None
        for peer in self.peers.values():
            entry = PeerRow(**peer.describe())
            if peer.role == "provider":
                served = peer.hello.caps["datasets"]
                datasets = sorted(served if not admin.scopes else (d for d in served if d in (named or ())))
                if admin.scopes and not datasets:
                    continue
                entry["endpoint"] = peer.hello.caps["endpoint"]
                entry["evaluations_left_today"] = self._evaluations_left(peer.hello.caps, datasets)
                entry["datasets"] = datasets
            elif peer.claims.jti != admin.jti and not all(
                set(peer.claims.scopes.get(name) or [None]) <= set(mine) for name, mine in admin.scopes.items()
            ):
                continue
            peers.append(entry)
        return PeerList(peers=peers)

    def _evaluations_left(self, caps: dict, datasets: list[str]) -> dict[str, int | None]:
        """Per dataset, the private test split's evaluations left today against the daily budget the
        provider charges with (its Hello's ``eval_per_dataset_day``; ``None``: it states none, or 0,
        unlimited). The budget is the dataset's, kept here for every replica (services/router/eval_budget.py)."""
        per_day = caps.get("eval_per_dataset_day")
        if isinstance(per_day, bool) or not isinstance(per_day, int) or not 0 < per_day <= 10**9:
            return dict.fromkeys(datasets)
        return {d: int(self.eval_budget.left(d, per_day)) for d in datasets}
