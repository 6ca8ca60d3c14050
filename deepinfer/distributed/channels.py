"""pyzmq channels between the DP front and its ranks, bound to 127.0.0.1 only.

Messages are Python objects pickled with protocol 5: numpy arrays and CPU tensors inside them travel
as out-of-band frames sent with copy=False, so their bytes are never copied into the pickle (zero-copy
on the send side; the receiver rebuilds arrays over the received frames)."""
import io
import pickle
import warnings

import numpy as np
import torch
import zmq


def _tensor_from_numpy(a: np.ndarray) -> torch.Tensor:
    """Wraps the received frame without copying; the frame is read-only, so is the tensor (by contract)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class _Pickler(pickle.Pickler):
    """Sends CPU tensors as numpy arrays, whose buffers protocol 5 moves out of band."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.dtype != torch.bfloat16:
            return _tensor_from_numpy, (obj.detach().contiguous().numpy(),)
        return NotImplemented


def encode(obj) -> list:
    """obj -> [pickle bytes, buffer, buffer, ...] (buffers are PickleBuffers, not copies)."""
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(obj)
    return [f.getvalue(), *buffers]


def decode(frames: list):
    """Inverse of encode; frames are zmq Frames or bytes."""
    head, *buffers = frames
    return pickle.loads(memoryview(head), buffers=[memoryview(b) for b in buffers])


class OutputReceiver:
    """The front's PULL socket: every rank pushes its finished requests here."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    def recv(self, timeout_ms: int) -> list:
        """Every message that arrives within timeout_ms (waits only for the first)."""
        out = []
        if not self.sock.poll(timeout_ms):
            return out
        while True:
            try:
                out.append(decode(self.sock.recv_multipart(zmq.NOBLOCK, copy=False)))
            except zmq.Again:
                return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class OutputSender:
    """A rank's PUSH socket towards the front."""

    def __init__(self, address: str):
        if not address.startswith("tcp://127.0.0.1:"):
            raise ValueError(f"output channel {address!r} must be on 127.0.0.1")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 5000)  # flush pending outputs on close, but never hang forever
        self.sock.connect(address)

    def send(self, obj) -> None:
        self.sock.send_multipart(encode(obj), copy=False)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
