"""A process that says it is a live trainer must prove it: host id and pid in ``Hello`` are the
peer's word, so a second session of a trainer's subject is admitted only with the nonce the
router's Welcome gave the live session's process. A thief holding the trainer's token (and its
host id and pid) but not the nonce is refused, and takes no task; once the real session is gone a
restarted trainer is admitted."""

from __future__ import annotations

import pytest

from libbus.connect.client import Client, Identity
from libbus.errors import Unavailable
from libbus.wire.messages import GetTask


def _trainer(endpoint: str, token: str, name: str) -> Client:
    return Client(
        endpoint,
        Identity(role="trainer", name=name, token=token, host_id="host-1", caps={"heartbeat": True}),
        timeout_s=5.0,
        retries=0,
    )


def test_a_trainer_token_without_the_session_nonce_cannot_take_over(router, make_token):
    token = make_token("trainer", sub="t1")
    real = _trainer(router.endpoint, token, "real")
    thief = _trainer(router.endpoint, token, "thief")  # same token, host id and pid; no nonce
    try:
        welcome = real.hello()
        assert welcome.nonce
        with pytest.raises(Unavailable, match="does not present its session nonce"):
            thief.hello()
        with pytest.raises(Unavailable):
            thief.request(GetTask(), timeout_s=5.0)
        # the real process opens another session with its nonce
        again = _trainer(router.endpoint, token, "real")
        try:
            assert again.hello().nonce == welcome.nonce
        finally:
            again.close()
        real.close()  # Goodbye: the identity is free, a restarted trainer is admitted
        assert thief.hello().session
    finally:
        real.close()
        thief.close()
