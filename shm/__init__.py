"""Same-host delivery through POSIX shared-memory rings (DESIGN §4).

Not built yet: batches travel over the socket path today. The ring, its slot protocol and CUDA
pinning arrive with the shared-memory issue; this package imports neither zmq nor torch.
"""
