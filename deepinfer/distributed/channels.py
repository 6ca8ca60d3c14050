"""pyzmq channels between a front and its engine processes (DP ranks, prefill and decode engines), and
between prefill and decode engines, bound to 127.0.0.1 only.

Messages are Python objects pickled with protocol 5: numpy arrays and CPU tensors inside them travel
as out-of-band frames sent with copy=False, so their bytes are never copied into the pickle (zero-copy
on the send side; the receiver rebuilds arrays over the received frames)."""
import io
import pickle
import warnings

import numpy as np
import torch
import zmq


# dtypes numpy lacks travel as an integer view of the same width (bytes unchanged) and are viewed back.
_NO_NUMPY = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8,
             torch.float8_e8m0fnu: torch.uint8}


def _tensor_from_numpy(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Wraps the received frame without copying; the frame is read-only, so is the tensor (by contract)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    return t if dtype is None else t.view(dtype)


class _Pickler(pickle.Pickler):
    """Sends CPU tensors as numpy arrays, whose buffers protocol 5 moves out of band."""

    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            return NotImplemented
        t = obj.detach().contiguous()
        if t.dtype in _NO_NUMPY:
            return _tensor_from_numpy, (t.view(_NO_NUMPY[t.dtype]).numpy(), t.dtype)
        return _tensor_from_numpy, (t.numpy(),)


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


class Receiver:
    """A PULL socket on a random 127.0.0.1 port: a front's output channel, or an engine process's inbox."""

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


class Sender:
    """A PUSH socket towards a Receiver."""

    def __init__(self, address: str):
        if not address.startswith("tcp://127.0.0.1:"):
            raise ValueError(f"channel {address!r} must be on 127.0.0.1")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 5000)  # flush pending outputs on close, but never hang forever
        self.sock.connect(address)

    def send(self, obj) -> int:
        """Queues obj; returns the bytes it occupies on the wire (pickle head plus out-of-band buffers)."""
        frames = encode(obj)
        self.sock.send_multipart(frames, copy=False)
        return sum(memoryview(f).nbytes for f in frames)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
