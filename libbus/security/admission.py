"""Admission at the handshake: no peer without a valid token gets a byte into a service's memory.

libzmq buffers a multipart message until its last frame arrives, and neither ``MAXMSGSIZE`` (per
frame) nor the high-water mark (whole messages) bounds an endless one: a peer that never proves
anything could grow a service's memory without limit before its ``Hello`` is ever read. So every
batchbus server socket runs a ZAP handler and admits a connection only after its handshake:

- with CURVE on, the connection's public key must be listed (:mod:`libbus.security.curve`);
- without CURVE, the ZMTP ``PLAIN`` mechanism carries the peer's token (first half as the user
  name, second half as the password: each field holds 255 bytes, so tokens up to 510 bytes) and
  :class:`TokenAuthenticator` verifies it (signature, audience, issuer, expiry, revocation) before
  libzmq reads a single message. The connection's ``User-Id`` is the token's subject.

``Hello`` still carries the token and is checked again: the handshake is only the door.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from libbus.errors import BusError, ConfigError
from libbus.security.curve import ZAP_DOMAIN
from libbus.security.zap import ZapThreadAuthenticator

__all__ = ["TokenAuthenticator", "MAX_HANDSHAKE_TOKEN", "admit_server", "admit_client"]

log = logging.getLogger(__name__)

#: PLAIN's user name and password are one length byte each: 2 × 255 bytes of token.
MAX_HANDSHAKE_TOKEN = 510


class TokenAuthenticator(ZapThreadAuthenticator):
    """A ZAP handler thread that admits PLAIN connections presenting a valid token.

    Args:
        ctx: the server's own context (one ZAP handler per context).
        verify: checks a token and returns its subject, raising :class:`BusError` when it is not
            acceptable (the server's own verification, revocations included).
    """

    def __init__(self, ctx: zmq.Context, verify: Callable[[str], str]):
        super().__init__(ctx, log=log.getChild("zap"))
        self.verify = verify
        self.refused = 0

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) < 6 or msg[5] != b"PLAIN" or len(msg) != 8:
            if len(msg) >= 2:
                self.refused += 1
                self._send_zap_reply(msg[1], b"400", b"a token is required at the handshake")
            return
        request_id, domain = msg[1], msg[2]
        token = (msg[6] + msg[7]).decode("utf-8", "replace")
        if domain != ZAP_DOMAIN.encode():
            self.refused += 1
            self._send_zap_reply(request_id, b"400", b"unknown ZAP domain")
            return
        try:
            subject = self.verify(token)
        except BusError as err:
            self.refused += 1
            log.info("handshake refused from %s: %s", msg[3].decode("utf-8", "replace"), err)
            self._send_zap_reply(request_id, b"400", str(err).encode()[:200])
            return
        except Exception:  # noqa: BLE001 - a bug here must refuse, never admit
            self.refused += 1
            log.exception("handshake check failed")
            self._send_zap_reply(request_id, b"500", b"internal error")
            return
        self._send_zap_reply(request_id, b"200", b"OK", subject)


def admit_server(sock: zmq.Socket) -> None:
    """Make ``sock`` a PLAIN server in the batchbus ZAP domain, refusing all when no handler runs."""
    sock.plain_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def admit_client(sock: zmq.Socket, token: str) -> None:
    """Present ``token`` in the PLAIN handshake of ``sock`` (before it connects).

    Raises :class:`ConfigError` for a token longer than :data:`MAX_HANDSHAKE_TOKEN` bytes."""
    data = token.encode()
    if not data or len(data) > MAX_HANDSHAKE_TOKEN:
        raise ConfigError(
            f"a token of {len(data)} bytes cannot ride in the connection handshake (1 to "
            f"{MAX_HANDSHAKE_TOKEN} bytes without CURVE): issue one with fewer scopes, "
            "or run the cluster with curve = true"
        )
    half = (len(data) + 1) // 2
    sock.plain_username = data[:half]
    sock.plain_password = data[half:] or b"-"
