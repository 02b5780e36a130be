"""A ZAP handler thread that a context's termination ends: the one safe way to stop a server's handler.

libzmq asks the ZAP handler about every handshake (PLAIN's token, CURVE's key) from its I/O thread, and
aborts the whole process if the handler is gone when it asks (``errno_assert`` in ``zap_client.cpp``:
the request has nowhere to go). A server socket's connections outlive ``close()`` for a moment (libzmq
reaps them in the background), so a handler stopped right after the socket's close can meet a handshake
still in flight. Only ``zmq_ctx_term`` knows when every connection is gone, and it waits for every
socket, the handler's own too. (A test worker that aborted in libzmq during a flooded server's teardown
did so again with this order in place: that abort has a cause of its own, see
tests/security/test_security_memory.py.)

So :class:`ZapThreadAuthenticator` keeps answering until the context terminates: its thread closes the
handler's sockets when termination reaches them (``ETERM``), and :meth:`~ZapThreadAuthenticator.terminate`
terminates the context with the handler still in place, then joins the thread. A context shared with
other sockets cannot be terminated here: :meth:`stop` (pyzmq's) is still there for it.
"""

from __future__ import annotations

import asyncio

import zmq
from zmq.auth.base import Authenticator
from zmq.auth.thread import AuthenticationThread, ThreadAuthenticator

__all__ = ["ZapThreadAuthenticator"]


class _ZapThread(AuthenticationThread):
    """pyzmq's handler thread on a plain :class:`zmq.Poller` (pyzmq's asyncio poller reports ``ETERM`` to
    the event loop, not to the thread, which then waits for ever), ending when its context terminates."""

    def run(self) -> None:
        loop = asyncio.new_event_loop()  # each handshake's answer is a coroutine (handle_zap_message)
        zap = self.authenticator.zap_socket
        poller = zmq.Poller()
        poller.register(self.pipe, zmq.POLLIN)
        poller.register(zap, zmq.POLLIN)
        self.started.set()
        try:
            while True:
                events = dict(poller.poll())
                if self.pipe in events and self._handle_pipe_message(self.pipe.recv_multipart()):
                    return  # TERMINATE: pyzmq's stop()
                if zap in events:
                    loop.run_until_complete(self.authenticator.handle_zap_message(zap.recv_multipart()))
        except zmq.ZMQError as err:  # ETERM: the context is terminating, and waits for these sockets
            if err.errno != zmq.ETERM:
                self.log.warning("ZAP handler stopped: %s", err)
        finally:
            zap.close(0)
            self.authenticator.zap_socket = None  # type: ignore[assignment]
            if self.pipe is not None:
                self.pipe.close(0)
                self.pipe = None  # type: ignore[assignment]
            loop.close()


class ZapThreadAuthenticator(ThreadAuthenticator):
    """:class:`~zmq.auth.thread.ThreadAuthenticator` whose handler answers until its context terminates."""

    def start(self) -> None:
        """Bind the ZAP socket and start the handler thread (pyzmq's start, with :class:`_ZapThread`)."""
        Authenticator.start(self)
        self.pipe = self.context.socket(zmq.PAIR, socket_class=zmq.Socket)
        self.pipe.linger = 1
        self.pipe.bind(self.pipe_endpoint)
        thread_pipe = self.context.socket(zmq.PAIR, socket_class=zmq.Socket)
        thread_pipe.linger = 1
        thread_pipe.connect(self.pipe_endpoint)
        self.thread = _ZapThread(authenticator=self, pipe=thread_pipe)
        self.thread.start()
        if not self.thread.started.wait(timeout=10):
            raise RuntimeError("ZAP handler thread failed to start")

    def terminate(self) -> None:
        """Terminate this handler's context, the handler answering handshakes until every other socket of
        the context is gone, then join its thread. The caller has closed its own sockets of the context."""
        if self.pipe is not None:
            self.pipe.close(0)  # our end of the command pipe: the thread's end closes on ETERM
            self.pipe = None  # type: ignore[assignment]
        if not self.is_alive() and self.zap_socket is not None:
            self.zap_socket.close(0)  # a thread that died early left it open: term would wait for it
            self.zap_socket = None  # type: ignore[assignment]
        self.context.term()
        if self.thread is not None:
            self.thread.join()
            self.thread = None  # type: ignore[assignment]
