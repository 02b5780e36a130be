"""CUDA hand-off: pin a whole ring once, copy filled slots to the GPU on a side stream.

The only module of :mod:`shm` that touches torch, and it imports it lazily: a CPU-only provider
never loads CUDA. ``cudaHostRegister`` makes the ring's pages DMA-able in place, so a slot goes to
the device with one asynchronous copy and no staging buffer.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from shm.errors import ShmError

__all__ = ["CudaStager"]

#: cudaHostRegisterPortable: pinned for every CUDA context, not only the current device's.
_REGISTER_PORTABLE = 1


class CudaStager:
    """Copies ring slots to ``device`` asynchronously; the caller frees a slot once its event is done.

    Args:
        buf: the ring's whole mapping; it stays registered (and mapped) until :meth:`close`.
        device: a CUDA device, e.g. ``"cuda:0"``.
    Raises:
        ShmError: CUDA is unavailable or refuses to register the memory.
    """

    def __init__(self, buf: mmap.mmap, device: Any):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise ShmError(f"device {device} is not an available CUDA device")
        # The array holds an export of the mapping: the ring cannot be unmapped while pinned.
        self._pages: np.ndarray | None = np.frombuffer(memoryview(buf), np.uint8)
        self._ptr = self._pages.ctypes.data
        with torch.cuda.device(self.device):
            err = int(torch.cuda.cudart().cudaHostRegister(self._ptr, self._pages.nbytes, _REGISTER_PORTABLE))
            if err != 0:
                self._pages = None
                raise ShmError(f"cudaHostRegister of {len(buf)} bytes failed with CUDA error {err}")
            self.stream = torch.cuda.Stream(self.device)

    def copy(self, x: np.ndarray, y: np.ndarray):
        """Start copying ``x`` and ``y`` (views of a slot) to the device.

        Returns ``(x_cuda, y_cuda, event)``: the slot may be reused once ``event.query()`` is true.
        """
        torch = self.torch
        with torch.cuda.stream(self.stream):
            xc = torch.from_numpy(x).to(self.device, non_blocking=True)
            yc = torch.from_numpy(y).to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return xc, yc, event

    def hand_over(self, xc, yc, event) -> None:
        """Make the caller's current stream wait for the copy, and tell the allocator it uses them."""
        current = self.torch.cuda.current_stream(self.device)
        current.wait_event(event)
        xc.record_stream(current)
        yc.record_stream(current)

    def close(self) -> None:
        """Wait for copies in flight, then unregister (always before the ring is unmapped)."""
        if self._pages is None:
            return
        self.stream.synchronize()
        with self.torch.cuda.device(self.device):
            self.torch.cuda.cudart().cudaHostUnregister(self._ptr)
        self._pages = None
