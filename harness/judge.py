"""The judge: graded tests whose verdict the student's code cannot reach.

With KVCOURSE_JUDGE set (a JSON list: the command that starts the worker), the pytest process
that runs the tests never imports a lesson package. Every `import lN_...` gives a proxy module
instead, and every use of what it holds (a function called, a class built, an attribute read)
is a request to a worker process, which imports the student's code and runs it. What comes back
is plain data (numbers, strings, containers of them, tensors as dtype + shape + raw bytes; never
pickle, never code) or a handle to an object that stays in the worker. The tests' assertions,
the HF oracle and the report of each outcome all run in the judging process, so code in the
worker can change only what its own functions return, which is what is graded.

The same test files run unchanged in one process when KVCOURSE_JUDGE is unset (a student's
`make check`): one test is still one function.

What crosses, and how (both directions use the same encoding):
- None, bool, int, str, float (NaN and infinities too), bytes, list, tuple, dict, set, frozenset,
  deque, range, slice, Ellipsis, pathlib paths, torch dtypes, devices and Sizes: by value.
- torch tensors: by value, on the CPU. A tensor the judge passes in and the worker changes in
  place (its version counter moved) is copied back into the judge's tensor when the call returns.
- exception classes and instances: rebuilt in the judge from their names, bases, args and str,
  so `pytest.raises(OutOfBlocksError)` and `isinstance(e, ValueError)` work; the worker's
  traceback is attached as a note.
- modules: by name (a lesson module is a proxy again, any other the judge's own import).
- anything else the worker holds: a handle; the judge's proxy forwards attribute reads and
  writes, calls, indexing, iteration, len, comparisons, hashing, str and context managers.
- anything else the judge passes (a callback, a test's own object): a handle the worker may only
  call, never read attributes of, so it cannot walk from a callback to the judge's globals.

What a test must do differently to run judged (one code path still; tests/probes.py):
- watch the student's code from inside the worker: a hook on torch's modules, a subclass of a
  lesson class, a data_ptr comparison go in tests/probes*.py, which the worker imports;
- hold a copy only as long as it means the worker's tensor: copies read from the worker and
  changed in place are written back before the judge's next message, for the test's duration;
- read much of an engine at once (its invariants after every step) through snapshot(), one
  request instead of one per attribute.
A probe, like everything in the worker, is the student's to change: what it records is data their
code produced, as any reply is; the judge's own arithmetic (expected ids, fingerprints.py) stays
in the judge.

Status (2026-11-27): the Gradescope runner (instructor/autograder/grade.py) judges every lesson's
tests (JUDGED_LESSONS there; notebooks are not graded there); measured judged on the solution:
L1-L3's graded tests 115/115, L10 19/19 (100 s; 13 s in one process), L12 22/22; L2's allocator file 4 s (1.4 s in
one process); L5 through the bundle 184/184 points (its four files 442 s; the 300-request soaks
check only the live requests each step, see tests/test_l5_invariants.py); L8's five files 124/124
points in 118 s (its property tests run half their random examples judged: tests/helpers.py
`budget`); L13's graded files 39/39 in 27 s (a step and the tables it left are one request:
tests/probes_l13.py); a fresh student copy 0/163 for L8 and L13 together; L11's graded files 26/26
in 23 s (the server, its engine thread and what changes that thread run in the worker:
tests/probes_l11.py; the HTTP clients and every check in the judge), a fresh copy 0/26; L14's graded
files 42/42 in 19 s (the stand-in requests, the connectors that watch a step, the folders the tiers
write and the two-process runs are made in the worker: tests/probes_l14.py), a fresh copy 0/42. A
test interrupted while the worker runs (its time limit) stops the worker, and pytest stops after that test (Endpoint.stop): the runner
goes on with the remaining tests and a new worker.
"""

from __future__ import annotations

import atexit
import builtins
import collections
import collections.abc
import contextlib
import copy
import enum
import functools
import gc
import importlib
import importlib.abc
import importlib.machinery
import json
import operator
import os
import pathlib
import struct
import subprocess
import sys
import threading
import traceback
import types
import weakref
from typing import Any

ENV = "KVCOURSE_JUDGE"
MAX_HEADER = 64 << 20  # bytes of one message's JSON
MAX_BLOB = 8 << 30     # bytes of one tensor or bytes value
MAX_DEPTH = 64         # nesting of containers in one value


class JudgeError(RuntimeError):
    """The worker broke the protocol, died, or asked for something it may not have."""


MUTABLE_CONTAINERS = (list, dict, set, collections.deque)
PLAIN_SCALARS = (type(None), bool, int, float, str)
_JSON_SCALARS = (type(None), bool, int, str)  # floats may be NaN, which JSON cannot carry as itself


def _all_plain(value) -> bool:
    """A container of scalars and strings only: one the judge can compare without a request."""
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    return all(type(item) in PLAIN_SCALARS for item in items)


@contextlib.contextmanager
def _collector_paused():
    """No garbage collection while a value is encoded or decoded: a snapshot makes thousands of
    objects, and each collection they trigger would walk torch's and transformers' millions
    (measured: a 300-request engine's snapshot encoded 4x slower with the collector on)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _all_plain_items(items) -> bool:
    """Ints, finite floats, strings, bools, None only: what JSON carries as itself."""
    for item in items:
        kind = type(item)
        if kind is float:
            if item != item or item in (float("inf"), float("-inf")):
                return False
        elif kind not in PLAIN_SCALARS:
            return False
    return True


# ---------------------------------------------------------------- framing


class Channel:
    """Length-prefixed messages over two pipes: a JSON header, then its blobs (raw bytes)."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    def send(self, message: dict, blobs: list[bytes]) -> None:
        header = json.dumps({**message, "blob_sizes": [len(b) for b in blobs]}).encode()
        self.writer.write(struct.pack(">Q", len(header)) + header)
        for blob in blobs:
            self.writer.write(blob)
        self.writer.flush()

    def recv(self) -> tuple[dict, list[bytes]]:
        (size,) = struct.unpack(">Q", self._read(8))
        if size > MAX_HEADER:
            raise JudgeError(f"a message header of {size} bytes (the limit is {MAX_HEADER})")
        message = json.loads(self._read(size))
        if not isinstance(message, dict) or not isinstance(message.get("blob_sizes"), list):
            raise JudgeError("a message that is not a JSON object with blob_sizes")
        blobs = []
        for blob_size in message["blob_sizes"]:
            if not isinstance(blob_size, int) or not 0 <= blob_size <= MAX_BLOB:
                raise JudgeError(f"a blob of {blob_size!r} bytes")
            blobs.append(self._read(blob_size))
        return message, blobs

    def _read(self, size: int) -> bytes:
        data = self.reader.read(size)
        if data is None or len(data) != size:
            raise JudgeError("the worker closed the channel (it exited or was killed)")
        return data


# ---------------------------------------------------------------- values


def _torch():
    return sys.modules.get("torch") or importlib.import_module("torch")


def _is_tensor(value) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


class _ByHandle:
    """A value to send as a handle whatever its type."""

    def __init__(self, obj):
        self.obj = obj


class Endpoint:
    """One side of the channel: it exports its own objects as numbered handles, proxies the
    peer's, and serves the peer's requests while it waits for the reply to its own (a callback)."""

    def __init__(self, channel: Channel, side: str):
        assert side in ("judge", "worker")
        self.channel, self.side = channel, side
        self.exported: dict[int, Any] = {}
        self.export_ids: dict[int, int] = {}  # id(obj) -> handle, while exported
        self.sent: dict[int, int] = {}        # handle -> times sent; the peer releases as many
        self.next_handle = 1
        self.proxies: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.received: dict[int, int] = {}    # the peer's handle -> times received, while proxied
        # [handle, times received] of proxies that died: a handle sent again meanwhile stays
        self.released: list[list[int]] = []
        self.lock = threading.RLock()
        self.pinned: dict[int, Any] = {}  # proxies kept for good: enum members, compared with `is`
        self.members: dict[tuple[int, str], Any] = {}  # (class handle, name) -> its enum member
        self.member_names: dict[int, str] = {}  # a pinned member's handle -> its name
        self.functions: dict[tuple[str, str], Any] = {}  # (module, name) -> proxy, see _module_handle
        self.tracked: dict[int, tuple] = {}  # judge: id(copy) -> (weakref, origin, version, data_ptr)
        # The copies received during the current test, held until it ends, so that one changed
        # and dropped at once (`for t in pool.K + pool.V: t.fill_(nan)`) is still sent back.
        self.fresh: list = []
        self.containers: list[tuple] = []  # judge: (copy, origin, snapshot) of plain containers
        self.broken = ""  # why the channel may not be used again, once it may not
        self.process: subprocess.Popen | None = None  # judge: the worker

    def stop(self, why: str) -> None:
        """Use the channel no more (every later request raises JudgeError(why)); kill the worker."""
        self.broken = self.broken or why
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    # ------------------------------------------------ handles

    def export(self, obj) -> int:
        handle = self.export_ids.get(id(obj))
        if handle is None or self.exported.get(handle) is not obj:
            handle, self.next_handle = self.next_handle, self.next_handle + 1
            self.exported[handle], self.export_ids[id(obj)] = obj, handle
        self.sent[handle] = self.sent.get(handle, 0) + 1
        return handle

    def release(self, released) -> None:
        for item in released:
            handle, count = item if isinstance(item, list) and len(item) == 2 else (None, 0)
            if handle not in self.exported or not isinstance(count, int):
                continue
            self.sent[handle] -= count
            if self.sent[handle] <= 0:
                obj = self.exported.pop(handle)
                self.export_ids.pop(id(obj), None)
                del self.sent[handle]

    def proxy(self, handle: int):
        proxy = self.proxies.get(handle)
        if proxy is None:
            proxy = (RemoteObject if self.side == "judge" else CallbackProxy)(self, handle)
            self.proxies[handle] = proxy
        self.received[handle] = self.received.get(handle, 0) + 1
        return proxy

    def forget(self, handle: int) -> None:
        """A proxy of `handle` died: tell the peer, with how many times it was received (less the
        tensors copied from it that are still alive: their finalizers release those)."""
        alive = sum(1 for _, origin, _, _ in self.tracked.copy().values() if origin == handle)  # see _dirty_tensors
        count = self.received.get(handle, 0) - alive
        if alive:
            self.received[handle] = alive
        else:
            self.received.pop(handle, None)
        self.released.append([handle, count])

    def own(self, handle) -> Any:
        if not isinstance(handle, int) or handle not in self.exported:
            raise JudgeError(f"no object has handle {handle!r} here")
        return self.exported[handle]

    # ------------------------------------------------ encoding

    def encode(self, value, blobs: list, tensors: list | None = None, depth: int = 0):
        """value -> JSON-able; tensors (when given) collects the tensors sent, for write-back."""
        if depth > MAX_DEPTH:
            raise JudgeError(f"a value nested more than {MAX_DEPTH} deep")
        enc = lambda v: self.encode(v, blobs, tensors, depth + 1)  # noqa: E731
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, types.TracebackType):  # a context manager's __exit__: frames stay here
            return None
        if type(value) is _ByHandle:
            return {"t": "ref", "id": self.export(value.obj)}
        if isinstance(value, int) and type(value) is int:
            return value
        if isinstance(value, float) and type(value) is float:
            return value if value == value and abs(value) != float("inf") else {"t": "float", "v": repr(value)}
        if _is_tensor(value):
            tracked = self.tracked.get(id(value))
            if tracked is not None and tracked[0]() is value:  # a copy of the worker's: that tensor
                if tensors is not None:
                    tensors.append(value)
                return {"t": "yours", "id": tracked[1], "index": None if tensors is None else len(tensors) - 1}
            return self._encode_tensor(value, blobs, tensors)
        kind = type(value)
        if kind in (list, tuple, set, frozenset):
            encoded = {"t": kind.__name__, "v": [enc(v) for v in value]}
        elif kind is dict:
            encoded = {"t": "dict", "v": [[enc(k), enc(v)] for k, v in value.items()]}
        elif kind is collections.deque:
            encoded = {"t": "deque", "v": [enc(v) for v in value], "maxlen": value.maxlen}
        else:
            encoded = None
        if encoded is not None:
            if self.side == "worker" and kind in MUTABLE_CONTAINERS and _all_plain(value):
                encoded["origin"] = self.export(value)  # see _track_container
            return encoded
        if kind in (bytes, bytearray):
            blobs.append(bytes(value))
            return {"t": "bytes", "blob": len(blobs) - 1}
        if kind is range:
            return {"t": "range", "v": [value.start, value.stop, value.step]}
        if kind is slice:
            return {"t": "slice", "v": [enc(value.start), enc(value.stop), enc(value.step)]}
        if value is Ellipsis:
            return {"t": "ellipsis"}
        if isinstance(value, pathlib.PurePath):
            return {"t": "path", "v": str(value)}
        if isinstance(value, types.ModuleType) and not isinstance(value, RemoteModule):
            return {"t": "module", "v": value.__name__}
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Generator) and tensors is not None:
            # By its state; the worker's draws advance it, and the state comes back (as a tensor's
            # changes do), so the judge's generator goes on from where the worker's stopped.
            blobs.append(value.get_state().numpy().tobytes())
            tensors.append(value)
            return {"t": "generator", "blob": len(blobs) - 1, "device": str(value.device), "index": len(tensors) - 1}
        if torch is not None:
            if isinstance(value, torch.dtype):
                return {"t": "dtype", "v": str(value).removeprefix("torch.")}
            if isinstance(value, torch.device):
                return {"t": "device", "v": str(value)}
            if isinstance(value, torch.Size):
                return {"t": "size", "v": list(value)}
        if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            return enc(value.item())
        if isinstance(value, type) and issubclass(value, BaseException):
            return self._encode_exception_class(value)
        if isinstance(value, BaseException):
            return {"t": "exc", **self._exception_fields(value, blobs)}
        if isinstance(value, (RemoteObject, CallbackProxy)) and value._endpoint is self:
            return {"t": "yours", "id": value._handle}
        if type(value) is View:
            remote = object.__getattribute__(value, "_remote")
            if remote._endpoint is self:
                return {"t": "yours", "id": remote._handle}
        if type(value) is _Snapshot:
            return {"t": "snapshot", "v": self._encode_view_value(value.obj, blobs, {}, depth)}
        if isinstance(value, RemoteModule) and value._remote._endpoint is self:
            return {"t": "yours", "id": value._remote._handle}
        if isinstance(value, enum.Enum):  # pinned: `r.state is State.RUNNING` needs one proxy a member
            return {"t": "ref", "id": self.export(value), "pin": True, "member": str(value.name)}
        return {"t": "ref", "id": self.export(value)}

    def _encode_tensor(self, tensor, blobs, tensors):
        torch = _torch()
        data = tensor.detach()
        device = str(data.device)
        if data.layout != torch.strided or data.is_meta:
            return {"t": "ref", "id": self.export(tensor)}
        data = data.cpu().contiguous()
        blobs.append(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        if tensors is not None:
            tensors.append(tensor)
        return {"t": "tensor", "dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
                "device": device, "blob": len(blobs) - 1, "index": None if tensors is None else len(tensors) - 1,
                "parameter": isinstance(tensor, torch.nn.Parameter), "requires_grad": tensor.requires_grad,
                # the worker's tensor, for the judge's changes to its copy (see _dirty_tensors)
                "origin": self.export(tensor) if self.side == "worker" else None}

    def _encode_exception_class(self, cls) -> dict:
        if cls.__module__ == "builtins" and getattr(builtins, cls.__name__, None) is cls:
            return {"t": "exc_class", "module": "builtins", "name": cls.__name__, "bases": []}
        bases = [self._encode_exception_class(b) for b in cls.__bases__ if issubclass(b, BaseException)]
        return {"t": "exc_class", "module": cls.__module__, "name": cls.__qualname__, "bases": bases}

    def _encode_view_value(self, value, blobs, memo: dict, depth: int):
        """See snapshot(): objects of the lesson packages field by field (each once: `memo`),
        containers item by item, tensors and everything else as encode() sends them but tensors
        as handles (a view of an engine must not copy its pool)."""
        if depth > MAX_DEPTH:
            raise JudgeError(f"a value nested more than {MAX_DEPTH} deep")
        kind = type(value)
        if kind in PLAIN_SCALARS and kind is not float:
            return value
        enc = lambda v: self._encode_view_value(v, blobs, memo, depth + 1)  # noqa: E731
        if kind in (list, tuple, set, frozenset, collections.deque):
            name = "list" if kind is collections.deque else kind.__name__
            if _all_plain_items(value):  # token ids, block tables: as JSON's own list, read as one
                return {"t": name, "plain": list(value)}
            return {"t": name, "v": [enc(v) for v in value]}
        if kind is dict:
            return {"t": "dict", "v": [[enc(k), enc(v)] for k, v in value.items()]}
        if _is_tensor(value):
            return {"t": "ref", "id": self.export(value)}
        fields = _fields_of(value)
        if fields is None:
            return self.encode(value, blobs, None, depth)
        if id(value) in memo:
            return {"t": "viewref", "key": memo[id(value)][0]}
        key = len(memo)
        memo[id(value)] = (key, value)  # the object too: its id stays its own while encoding
        return {"t": "view", "key": key, "id": self.export(value),
                "fields": {str(n): v if type(v) in _JSON_SCALARS else enc(v) for n, v in fields.items()}}

    def _decode_view_value(self, data, blobs, memo: dict, depth: int = 0):
        if depth > MAX_DEPTH:
            raise JudgeError(f"a value nested more than {MAX_DEPTH} deep")
        if type(data) in PLAIN_SCALARS:
            return data
        dec = lambda v: self._decode_view_value(v, blobs, memo, depth + 1)  # noqa: E731
        kind = data.get("t") if isinstance(data, dict) else None
        if kind in ("list", "tuple", "set", "frozenset"):
            make = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind]
            if "plain" in data:
                items = data["plain"]
                if not isinstance(items, list) or not _all_plain_items(items):
                    raise JudgeError("a snapshot's plain list holds something else")
                return make(items)
            return make(dec(x) for x in data["v"])
        if kind == "dict":
            return {dec(k): dec(x) for k, x in data["v"]}
        if kind == "viewref":
            if data.get("key") not in memo:
                raise JudgeError("a snapshot that refers to an object it has not sent")
            return memo[data["key"]]
        if kind == "view":
            if not isinstance(data.get("id"), int) or not isinstance(data.get("fields"), dict):
                raise JudgeError("a snapshot's object without a handle or fields")
            view = View(self.proxy(data["id"]))
            memo[data.get("key")] = view  # before its fields: an object may refer back to itself
            object.__getattribute__(view, "_fields").update(
                {n: v if type(v) in PLAIN_SCALARS else dec(v) for n, v in data["fields"].items()})
            return view
        return self.decode(data, blobs, None, depth)

    def _exception_fields(self, exc: BaseException, blobs) -> dict:
        attrs = {}
        for name, attr in vars(exc).items():
            if not name.startswith("__"):
                try:
                    attrs[name] = self.encode(attr, blobs, None, 1)
                except JudgeError:
                    continue
        try:
            args = self.encode(list(exc.args), blobs, None, 1)
        except JudgeError:
            args = {"t": "list", "v": []}
        return {"cls": self._encode_exception_class(type(exc)), "args": args, "attrs": attrs, "str": str(exc),
                "tb": "".join(traceback.format_exception(exc))[-8000:]}

    def decode(self, data, blobs: list, received: list | None = None, depth: int = 0):
        if depth > MAX_DEPTH:
            raise JudgeError(f"a value nested more than {MAX_DEPTH} deep")
        if data is None or isinstance(data, (bool, int, float, str)):
            return data
        if not isinstance(data, dict) or not isinstance(data.get("t"), str):
            raise JudgeError(f"not a value: {str(data)[:200]}")
        dec = lambda v: self.decode(v, blobs, received, depth + 1)  # noqa: E731
        kind, v = data["t"], data.get("v")
        if kind in ("list", "tuple", "set", "frozenset", "dict", "deque"):
            if kind == "dict":
                value = {dec(k): dec(x) for k, x in v}
            elif kind == "deque":
                value = collections.deque((dec(x) for x in v), data.get("maxlen"))
            else:
                value = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](dec(x) for x in v)
            if self.side == "judge" and isinstance(data.get("origin"), int):
                self._track_container(value, data["origin"])
            return value
        if kind == "float":
            return float(v)
        if kind == "bytes":
            return blobs[data["blob"]]
        if kind == "range":
            return range(*v)
        if kind == "slice":
            return slice(*(dec(x) for x in v))
        if kind == "ellipsis":
            return Ellipsis
        if kind == "path":
            return pathlib.Path(v)
        if kind == "module":
            return importlib.import_module(v)
        if kind == "dtype":
            return getattr(_torch(), v)
        if kind == "device":
            return _torch().device(v)
        if kind == "size":
            return _torch().Size(v)
        if kind == "tensor":
            return self._decode_tensor(data, blobs, received)
        if kind == "generator" and self.side == "worker":
            torch = _torch()
            generator = torch.Generator(device=str(data.get("device", "cpu")))
            generator.set_state(torch.frombuffer(bytearray(blobs[data["blob"]]), dtype=torch.uint8))
            if received is not None and isinstance(data.get("index"), int):
                received.append((data["index"], generator, None))
            return generator
        if kind == "exc_class":
            return exception_class(data)
        if kind == "exc":
            return rebuild_exception(data, self.decode(data["args"], blobs), {k: self.decode(a, blobs)
                                                                              for k, a in data["attrs"].items()})
        if kind == "yours":
            obj = self.own(data.get("id"))
            if _is_tensor(obj) and received is not None and data.get("index") is not None and not obj.is_inference():
                received.append((data["index"], obj, obj._version))
            return obj
        if kind == "snapshot" and self.side == "judge":
            return self._decode_view_value(v, blobs, {}, depth)
        if kind == "ref":
            if not isinstance(data.get("id"), int):
                raise JudgeError("a handle that is not an integer")
            proxy = self.proxy(data["id"])
            if data.get("pin"):
                self.pinned[data["id"]] = proxy
                self.member_names[data["id"]] = data.get("member")
            return proxy
        raise JudgeError(f"unknown value kind {kind!r}")

    def _decode_tensor(self, data, blobs, received):
        torch = _torch()
        dtype = getattr(torch, data["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise JudgeError(f"not a dtype: {data['dtype']!r}")
        raw = blobs[data["blob"]]
        shape = [int(s) for s in data["shape"]]
        tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if raw else \
            torch.empty(shape, dtype=dtype)
        device = data.get("device", "cpu")
        if device != "cpu" and self.side == "worker":
            tensor = tensor.to(device)
        if data.get("parameter"):
            tensor = torch.nn.Parameter(tensor, requires_grad=bool(data.get("requires_grad")))
        elif data.get("requires_grad") and tensor.is_floating_point():
            tensor.requires_grad_(True)
        # Inference tensors (decoded inside torch.inference_mode) keep no version counter, and
        # cannot be changed in place outside it: nothing to write back.
        if received is not None and data.get("index") is not None and not tensor.is_inference():
            received.append((data["index"], tensor, tensor._version))
        if self.side == "judge" and isinstance(data.get("origin"), int):
            if tensor.is_inference():
                self.released.append([data["origin"], 1])
            else:
                self._track(tensor, data["origin"])
        return tensor

    # ------------------------------------------------ the judge's changes to the worker's tensors

    def _track(self, tensor, origin: int) -> None:
        """A tensor read from the worker is a copy. A test that changes it in place (fills a pool
        with NaN, poisons a cache) means to change the worker's: before the judge's next message,
        the changed copies are sent back and written into their origins."""
        self.received[origin] = self.received.get(origin, 0) + 1
        key = id(tensor)
        self.tracked[key] = (weakref.ref(tensor), origin, tensor._version, tensor.data_ptr())
        self.fresh.append(tensor)
        weakref.finalize(tensor, self._untrack, key, origin)

    def _untrack(self, key: int, origin: int) -> None:
        self.tracked.pop(key, None)
        self.released.append([origin, 1])
        self.received[origin] = self.received.get(origin, 1) - 1
        if self.received[origin] <= 0:
            del self.received[origin]

    def _dirty_tensors(self, blobs: list) -> list:
        synced = []
        # NOTE: over a copy taken in one step. Garbage collection can run at any allocation in the
        # loop and finalize a tracked tensor, whose _untrack pops it from self.tracked: iterating
        # the dict itself failed judged tests at random ("dictionary changed size during iteration").
        for key, (ref, origin, version, pointer) in self.tracked.copy().items():
            tensor = ref()
            if tensor is None or (tensor._version == version and tensor.data_ptr() == pointer):
                continue
            data = tensor.detach().cpu().contiguous()
            blobs.append(data.view(_torch().uint8).numpy().tobytes() if data.numel() else b"")
            synced.append({"origin": origin, "blob": len(blobs) - 1, "dtype": str(data.dtype).removeprefix("torch."),
                           "shape": list(data.shape)})
            self.tracked[key] = (ref, origin, tensor._version, tensor.data_ptr())
        return synced

    def drop_copies(self) -> None:
        """Called after each test: the copies it held may go (their origins are released)."""
        self.fresh.clear()
        for _, origin, _ in self.containers:
            self.released.append([origin, 1])
        self.containers.clear()

    def _track_container(self, value, origin: int) -> None:
        """A list, dict, set or deque of plain values read from the worker, as _track does for
        tensors: `req.output_ids.append(token)` in a test means the worker's list."""
        self.containers.append((value, origin, copy.copy(value)))

    def _dirty_containers(self) -> list:
        synced, kept = [], []
        for entry in self.containers:
            value, origin, snapshot = entry
            if type(value) is not type(snapshot) or value != snapshot or \
                    (type(value) is collections.deque and list(value) != list(snapshot)):
                synced.append({"origin": origin, "value": self.encode(value, [], None, 1)})
                snapshot = copy.copy(value)
            # Held only by this entry and the names here: the test let it go (after changing it,
            # `req.output_ids.append(t)`, sent above); its origin may go too. (Lists cannot be
            # weakly referenced, and scanning every copy a test ever read made each message
            # slower than the last.)
            if sys.getrefcount(value) <= 3:
                self.released.append([origin, 1])
                continue
            kept.append((value, origin, snapshot))
        self.containers = kept
        return synced

    def _apply_sync(self, synced, blobs) -> None:
        torch = _torch()
        for item in synced or []:
            origin = self.own(item.get("origin"))
            if "value" in item:  # a container
                new = self.decode(item["value"], blobs)
                if type(new) is not type(origin) or not _all_plain(new):
                    raise JudgeError("a container written back as another type")
                if isinstance(origin, list):
                    origin[:] = new
                else:
                    origin.clear()
                    origin.update(new) if isinstance(origin, (dict, set)) else origin.extend(new)
                continue
            if not _is_tensor(origin):
                raise JudgeError("a write-back to something that is not a tensor")
            new = self._decode_tensor({**item, "t": "tensor", "device": str(origin.device)}, blobs, None)
            with torch.no_grad():
                if new.shape == origin.shape and new.dtype == origin.dtype:
                    origin.copy_(new)
                else:
                    origin.data = new.to(origin.device)

    # ------------------------------------------------ requests

    def request(self, op: str, **fields):
        # One exchange at a time: a test's server thread and its main thread share the worker.
        # Re-entrant, for a callback that the worker calls while this thread waits.
        with self.lock:
            return self._request(op, **fields)

    def _request(self, op: str, **fields):
        if self.broken:
            raise JudgeError(self.broken)
        blobs: list[bytes] = []
        sent_tensors: list = []
        release, self.released = self.released, []  # a finalizer may append while the message is built
        message = {"kind": "request", "op": op, "release": release}
        for name, value in fields.items():
            message[name] = self.encode(value, blobs, sent_tensors) if name in ("args", "kwargs", "value") else value
        if self.side == "judge":
            message["sync"] = self._dirty_tensors(blobs) + self._dirty_containers()
        try:
            self.channel.send(message, blobs)
            while True:
                reply, reply_blobs = self.channel.recv()
                if reply.get("kind") != "request":
                    break
                self.serve(reply, reply_blobs)
        except BaseException as exc:
            # Stopped between a request and its reply (a test's time limit, Ctrl-C, a dead worker):
            # the reply may still come, and would answer the next request. No request is sent again.
            if self.side == "judge":
                self.stop(f"the grading worker was stopped when a test was interrupted ({type(exc).__name__}) "
                          "while your code ran; the tests after it cannot use it")
            raise
        if reply.get("kind") != "reply":
            raise JudgeError(f"expected a reply, got {str(reply)[:200]}")
        if self.side == "worker":
            self._apply_sync(reply.get("sync"), reply_blobs)
        for index, blob_index in reply.get("writeback", []):
            self._write_back(sent_tensors, index, reply_blobs[blob_index])
        if "error" in reply:
            error = reply["error"]
            raise rebuild_exception(error, self.decode(error["args"], reply_blobs),
                                    {k: self.decode(a, reply_blobs) for k, a in error["attrs"].items()})
        with _collector_paused():
            return self.decode(reply.get("value"), reply_blobs)

    def _write_back(self, sent, index, blob) -> None:
        torch = _torch()
        if not isinstance(index, int) or not 0 <= index < len(sent):
            raise JudgeError(f"a write-back to tensor {index!r}, which was not sent")
        target = sent[index]
        if isinstance(target, torch.Generator):
            target.set_state(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            return
        if len(blob) != target.numel() * target.element_size():
            raise JudgeError("a write-back of another size than the tensor sent")
        if blob:
            target.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(target.dtype).reshape(target.shape))

    def serve(self, message: dict, blobs: list) -> None:
        self.release(message.get("release") or [])
        if self.side == "worker":
            self._apply_sync(message.get("sync"), blobs)
        received: list = []
        reply: dict = {"kind": "reply"}
        reply_blobs: list[bytes] = []
        try:
            value = self._perform(message, blobs, received)
            with _collector_paused():
                reply["value"] = self.encode(value, reply_blobs)
        except JudgeError:
            if self.side == "judge":  # the worker broke the protocol: this test fails
                raise
            reply.pop("value", None)
            reply["error"] = self._exception_fields(sys.exc_info()[1], reply_blobs)
        except BaseException as exc:  # the peer's request failed: the exception goes back as data
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) and self.side == "judge":
                raise
            reply.pop("value", None)
            reply["error"] = self._exception_fields(exc, reply_blobs)
        writeback = []
        for index, tensor, version in received:
            if not _is_tensor(tensor):  # a generator: its state, always
                reply_blobs.append(tensor.get_state().numpy().tobytes())
                writeback.append([index, len(reply_blobs) - 1])
            elif tensor._version != version:
                blob = tensor.detach().cpu().contiguous()
                reply_blobs.append(blob.view(_torch().uint8).numpy().tobytes() if blob.numel() else b"")
                writeback.append([index, len(reply_blobs) - 1])
        reply["writeback"] = writeback
        if self.side == "judge":
            reply["sync"] = self._dirty_tensors(reply_blobs) + self._dirty_containers()
        self.channel.send(reply, reply_blobs)

    def _perform(self, message: dict, blobs: list, received: list):
        op = message.get("op")
        decode = lambda name, default: (self.decode(message[name], blobs, received)  # noqa: E731
                                        if name in message else default)
        if op == "release":
            return None
        if self.side == "judge":
            # The worker may only call what the judge handed it: no attribute of a judge-side
            # object is readable from there (from a function, __globals__ leads everywhere).
            if op != "call":
                raise JudgeError(f"the worker asked the judge for {op!r}; only calls of callbacks are served")
            return self.own(message.get("id"))(*decode("args", []), **decode("kwargs", {}))
        if op == "import":  # a handle, not the module's name, which would send the judge here again
            return _ByHandle(importlib.import_module(str(message["name"])))
        if op == "snapshot":
            return _Snapshot(decode("value", None))
        target = self.own(message.get("id"))
        if op == "getattr":
            return getattr(target, str(message["name"]))
        if op == "setattr":
            value = decode("value", None)
            if isinstance(value, CallbackProxy) and isinstance(target, type):
                value = _as_method(value)  # a function on a class binds self, as the test's did
            return setattr(target, str(message["name"]), value)
        if op == "delattr":
            return delattr(target, str(message["name"]))
        if op == "call":
            return target(*decode("args", []), **decode("kwargs", {}))
        if op == "plain":
            return plain_copy(target)
        if op == "operator":
            function = OPERATORS.get(message.get("name"))
            if function is None:
                raise JudgeError(f"unknown operator {message.get('name')!r}")
            return function(target, *decode("args", []))
        raise JudgeError(f"unknown request {op!r}")


# ---------------------------------------------------------------- exceptions rebuilt in the judge

_EXCEPTION_CLASSES: dict[tuple, type] = {}


def exception_class(data: dict) -> type:
    """The judge's class for an exception class the worker names. Only exceptions cross: a class
    that is not an Exception subclass here (KeyboardInterrupt, SystemExit, pytest's Skipped and
    Failed: BaseException's others, which steer the judge's own run) is never rebuilt as itself;
    the worker gets a plain Exception subclass of that name instead, which fails the test."""
    module, name = str(data.get("module")), str(data.get("name"))
    if module == "builtins":
        cls = getattr(builtins, name, None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls
    else:
        local = sys.modules.get(module)
        if local is not None and not isinstance(local, RemoteModule) and not module.startswith(("_pytest", "pytest")):
            cls = local  # e.g. a test's own exception class, raised through a callback
            for part in name.split("."):
                cls = getattr(cls, part, None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                return cls
    key = (module, name)
    if key not in _EXCEPTION_CLASSES:
        bases = tuple(exception_class(b) for b in data.get("bases", []) if isinstance(b, dict)) or (Exception,)
        try:
            cls = type(name.rsplit(".", 1)[-1], bases, {"__module__": module, "__str__": _remote_str})
        except TypeError:  # bases whose layouts conflict: keep the first
            cls = type(name.rsplit(".", 1)[-1], bases[:1], {"__module__": module, "__str__": _remote_str})
        cls.__qualname__ = name
        _EXCEPTION_CLASSES[key] = cls
    return _EXCEPTION_CLASSES[key]


def _remote_str(self) -> str:
    return self.__dict__.get("_remote_str", BaseException.__str__(self))


def rebuild_exception(data: dict, args, attrs: dict) -> BaseException:
    cls = exception_class(data["cls"])
    exc = cls.__new__(cls)
    exc.args = tuple(args)
    for name, value in attrs.items():
        try:
            setattr(exc, name, value)
        except (AttributeError, TypeError):
            pass
    if cls.__str__ is _remote_str:  # a builtin's str follows from its args, as in the worker
        exc.__dict__["_remote_str"] = data.get("str", "")
    exc.add_note("raised in the student's code (the grading worker):\n" + str(data.get("tb", ""))[-4000:])
    return exc


# ---------------------------------------------------------------- proxies in the judge


def _operator(name):
    def method(self, *args):
        return self._endpoint.request("operator", id=self._handle, name=name, args=list(args))
    method.__name__ = f"__{name}__"
    return method


_NO_VALUE = object()
_PLAIN_TYPES = (type(None), bool, int, float, str, bytes)


def _is_plain_data(value, depth: int = 0) -> bool:
    """Built-in scalars and containers of them, of exactly those types: what the judge compares."""
    if depth > MAX_DEPTH:
        return False
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return True
    if kind in (list, tuple, set, frozenset):
        return all(_is_plain_data(v, depth + 1) for v in value)
    if kind is dict:
        return all(_is_plain_data(k, depth + 1) and _is_plain_data(v, depth + 1) for k, v in value.items())
    return False


def plain_copy(value, depth: int = 0):
    """In the worker: `value` as exact built-in data (a subclass of list, int, ... by its underlying
    data, not its overridden methods; a named tuple as a tuple); TypeError for anything else."""
    if depth > MAX_DEPTH:
        raise TypeError("nested too deep to compare")
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return value
    copy = lambda v: plain_copy(v, depth + 1)  # noqa: E731
    if isinstance(value, enum.Enum):
        raise TypeError("an enum member is compared by identity")
    for base, read in ((int, int.__int__), (float, float.__float__), (str, str.__str__), (bytes, bytes.__bytes__)):
        if isinstance(value, base):
            return read(value)
    if isinstance(value, dict):
        return {copy(k): copy(v) for k, v in dict.items(value)}
    for base in (list, tuple, set, frozenset):
        if isinstance(value, base):
            return base(copy(v) for v in base.__iter__(value))
    raise TypeError(f"a {kind.__name__} has no plain value")


def _value_of(obj):
    """What the judge compares: its own objects as they are, a worker object by its plain value."""
    if isinstance(obj, RemoteObject):
        value = obj._plain()
        if value is _NO_VALUE:
            raise TypeError("an object of the student's code that is not plain data is compared only by identity")
        return value
    return obj


def _compare(name):
    compare = getattr(operator, name)

    def method(self, other):
        return compare(_value_of(self), _value_of(other))
    method.__name__ = f"__{name}__"
    return method


class RemoteObject:
    """An object that lives in the worker. Every use is a request; the answer is data or another
    RemoteObject."""

    __slots__ = ("_endpoint", "_handle", "_hash", "__weakref__")

    def __init__(self, endpoint: Endpoint, handle: int):
        object.__setattr__(self, "_endpoint", endpoint)
        object.__setattr__(self, "_handle", handle)

    def __hash__(self):
        # An object's hash may not change while it lives (a dict would lose it): asked once.
        try:
            return object.__getattribute__(self, "_hash")
        except AttributeError:
            value = self._endpoint.request("operator", id=self._handle, name="hash", args=[])
            object.__setattr__(self, "_hash", value)
            return value

    def __getattr__(self, name):
        endpoint = self._endpoint
        member = endpoint.members.get((self._handle, name))
        if member is not None:
            return member
        value = endpoint.request("getattr", id=self._handle, name=name)
        if isinstance(value, RemoteObject) and endpoint.pinned.get(value._handle) is value \
                and endpoint.member_names.get(value._handle) == name:
            # An enum's member read from its class (`State.RUNNING`, not `req.state`, which
            # changes): read once; an invariant check reads it for every request.
            endpoint.members[(self._handle, name)] = value
        return value

    def __setattr__(self, name, value):
        self._endpoint.members.pop((self._handle, name), None)
        self._endpoint.request("setattr", id=self._handle, name=name, value=value)

    def __delattr__(self, name):
        self._endpoint.members.pop((self._handle, name), None)
        self._endpoint.request("delattr", id=self._handle, name=name)

    def __call__(self, *args, **kwargs):
        return self._endpoint.request("call", id=self._handle, args=list(args), kwargs=kwargs)

    def _plain(self):
        """The object's value as exact built-in data, computed in the worker from its underlying
        data (plain_copy); _NO_VALUE when it has none (an instance of a lesson's class)."""
        if self._handle in self._endpoint.pinned:  # an enum member: compared by identity
            return _NO_VALUE
        try:
            value = self._endpoint.request("plain", id=self._handle)
        except JudgeError:
            raise
        except Exception:
            return _NO_VALUE
        if not _is_plain_data(value):
            raise JudgeError("the worker answered a request for plain data with something else")
        return value

    # Comparisons, membership and truth are the judge's: the worker sends a value and never sees
    # what it is compared with (a list subclass answering `==` with True would pass any assert).
    def __eq__(self, other):
        if isinstance(other, RemoteObject) and other._handle == self._handle:
            return True
        mine = self._plain()
        if mine is _NO_VALUE:
            return NotImplemented if not isinstance(other, RemoteObject) else False
        theirs = other._plain() if isinstance(other, RemoteObject) else other
        return theirs is not _NO_VALUE and mine == theirs

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __lt__, __le__, __gt__, __ge__ = _compare("lt"), _compare("le"), _compare("gt"), _compare("ge")

    def __contains__(self, item):
        value = self._plain()
        if value is not _NO_VALUE:
            return item in value
        # A lesson object (a tier): its own __contains__ answers, and only a bool may come back.
        answer = self._endpoint.request("operator", id=self._handle, name="contains", args=[item])
        if type(answer) is not bool:
            raise JudgeError(f"`in` answered with a {type(answer).__name__}, not a bool")
        return answer

    def __len__(self):
        value = self._plain()
        if value is not _NO_VALUE:
            return len(value)
        return self._endpoint.request("operator", id=self._handle, name="len", args=[])

    def __bool__(self):
        value = self._plain()
        if value is not _NO_VALUE:
            return bool(value)
        return self._endpoint.request("operator", id=self._handle, name="bool", args=[])

    def __iter__(self):
        iterator = self._endpoint.request("operator", id=self._handle, name="iter", args=[])
        if not isinstance(iterator, RemoteObject):
            yield from iterator
            return
        while True:
            try:
                yield iterator.__next__()
            except StopIteration:
                return

    def __instancecheck__(self, obj):
        return self._endpoint.request("operator", id=self._handle, name="instancecheck", args=[obj])

    def __subclasscheck__(self, cls):
        return self._endpoint.request("operator", id=self._handle, name="subclasscheck", args=[cls])

    def __del__(self):
        try:
            self._endpoint.forget(self._handle)
        except Exception:  # interpreter shutdown
            pass

    def __copy__(self):
        return self._endpoint.request("call", id=_module_handle(self._endpoint, "copy", "copy"), args=[self])

    def __deepcopy__(self, memo):
        return self._endpoint.request("call", id=_module_handle(self._endpoint, "copy", "deepcopy"), args=[self])

    def __reduce__(self):
        raise TypeError("an object of the student's code lives in the grading worker and cannot be pickled")

    __next__ = _operator("next")
    __str__ = _operator("str")
    __repr__ = _operator("repr")
    __int__ = _operator("int")
    __float__ = _operator("float")
    __index__ = _operator("index")
    __getitem__ = _operator("getitem")
    __setitem__ = _operator("setitem")
    __delitem__ = _operator("delitem")
    __add__ = _operator("add")
    __sub__ = _operator("sub")
    __mul__ = _operator("mul")
    __truediv__ = _operator("truediv")
    __floordiv__ = _operator("floordiv")
    __mod__ = _operator("mod")
    __neg__ = _operator("neg")
    __abs__ = _operator("abs")
    __enter__ = _operator("enter")
    __exit__ = _operator("exit")


class View:
    """A worker object's fields as they were when snapshot() read them: the values copied, so
    that reading them asks the worker nothing. Anything not a field (a method, a property) is
    asked of the object itself. Read-only: a test changes the worker's objects through the
    objects, not through a snapshot."""

    __slots__ = ("_fields", "_remote", "__weakref__")

    def __init__(self, remote: RemoteObject):
        object.__setattr__(self, "_fields", {})
        object.__setattr__(self, "_remote", remote)

    def __getattr__(self, name):
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        return getattr(object.__getattribute__(self, "_remote"), name)

    def __setattr__(self, name, value):
        raise AttributeError(f"cannot set {name!r}: a snapshot is read-only (change the object itself)")

    def __repr__(self):
        return f"<snapshot of {object.__getattribute__(self, '_remote')!r}>"


class _Snapshot:
    """What the worker sends field by field (see Endpoint._encode_view_value)."""

    def __init__(self, obj):
        self.obj = obj


@functools.cache
def _field_names(kind: type) -> tuple | None:
    """(slots, properties) of a lesson package's class; None for a class whose objects stay handles."""
    if kind.__module__.split(".")[0] not in lesson_packages() or issubclass(kind, (type, enum.Enum)) \
            or any("__call__" in vars(cls) for cls in kind.__mro__[:-1]):
        return None
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(kind, torch.nn.Module):
        return None
    slots, properties = [], []
    for cls in kind.__mro__:
        names = getattr(cls, "__slots__", ())
        slots += [n for n in ((names,) if isinstance(names, str) else names) if n not in ("__dict__", "__weakref__")]
        properties += [n for n, a in vars(cls).items() if isinstance(a, property)]
    return tuple(slots), tuple(properties)


def _fields_of(value) -> dict | None:
    """The fields of an object of a lesson package (instance attributes, slots, and properties as
    read now); None for anything else (enum members, classes, functions, callable objects, torch
    modules: those stay handles)."""
    names = _field_names(type(value))
    if names is None:
        return None
    slots, properties = names
    fields = dict(getattr(value, "__dict__", {}))
    for name in slots:
        if hasattr(value, name):
            fields[name] = getattr(value, name)
    for name in properties:
        if name not in fields:
            try:
                fields[name] = getattr(value, name)
            except Exception:  # raised again, from the object, if the test reads it
                pass
    return fields


def snapshot(value):
    """`value` (an object of the student's code, or a container of them) with its fields read in
    one request, recursively through the lesson packages' objects: for a test that reads much of
    an engine at once (its invariants after every step). In one process: `value` itself."""
    endpoint = ENDPOINT
    if endpoint is None:
        return value
    return endpoint.request("snapshot", value=value)


def _module_handle(endpoint: Endpoint, module: str, name: str) -> int:
    """The worker's handle of `module.name` (a standard-library function), fetched once."""
    cached = endpoint.functions.get((module, name))
    if cached is None:
        cached = endpoint.functions[(module, name)] = getattr(endpoint.request("import", name=module), name)
    return cached._handle


# What a RemoteObject's special methods do in the worker: Python's own operators, so that an
# `==` falls back to the reflected comparison as it would in one process.
OPERATORS = {
    "next": next, "bool": bool, "len": len, "hash": hash, "str": str, "repr": repr, "int": int,
    "float": float, "index": operator.index, "getitem": operator.getitem, "setitem": operator.setitem,
    "delitem": operator.delitem, "contains": operator.contains, "eq": operator.eq, "ne": operator.ne,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "add": operator.add,
    "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv, "floordiv": operator.floordiv,
    "mod": operator.mod, "neg": operator.neg, "abs": abs, "iter": iter,
    "enter": lambda obj: type(obj).__enter__(obj), "exit": lambda obj, *args: type(obj).__exit__(obj, *args),
    "instancecheck": lambda cls, obj: isinstance(obj, cls), "subclasscheck": lambda cls, sub: issubclass(sub, cls),
}


class CallbackProxy:
    """In the worker: a judge-side callable the judge passed in. Calling it is a request to the
    judge; nothing else about it can be read."""

    __slots__ = ("_endpoint", "_handle", "__weakref__")

    def __init__(self, endpoint: Endpoint, handle: int):
        self._endpoint, self._handle = endpoint, handle

    def __call__(self, *args, **kwargs):
        return self._endpoint.request("call", id=self._handle, args=list(args), kwargs=kwargs)

    def __getattr__(self, name):
        raise AttributeError(f"{name!r}: a grader-side object passed to your code can be called, not read")

    def __repr__(self):
        return f"<grader-side callable {self._handle}>"

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):  # a copied model keeps the test's hook, as in one process
        return self

    def __reduce__(self):
        raise TypeError("a grader-side callable cannot be pickled")

    def __del__(self):
        try:
            self._endpoint.forget(self._handle)
        except Exception:  # interpreter shutdown
            pass


def _as_method(callback: CallbackProxy):
    def method(*args, **kwargs):
        return callback(*args, **kwargs)
    return method


class RemoteModule(types.ModuleType):
    """A lesson module, as the judge sees it: its attributes are read from the worker's module."""

    def __init__(self, name: str, endpoint: Endpoint, remote: RemoteObject):
        super().__init__(name)
        types.ModuleType.__setattr__(self, "_remote", remote)
        types.ModuleType.__setattr__(self, "__path__", [])

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__") and name not in ("__file__", "__all__", "__doc__"):
            raise AttributeError(name)
        return getattr(self._remote, name)

    def __setattr__(self, name, value):
        if name.startswith("__") and name.endswith("__"):
            return super().__setattr__(name, value)
        if isinstance(value, RemoteModule) and value.__name__ == f"{self.__name__}.{name}":
            # The import system binding a submodule it just loaded here to its package. The
            # worker's package did that itself when it imported it, and may have bound the name
            # to something else since (`from .quantize import quantize`): its binding stands.
            return None
        setattr(self._remote, name, value)

    def __delattr__(self, name):
        delattr(self._remote, name)

    @property
    def __dict__(self):
        """The worker module's namespace (what monkeypatch reads to put an attribute back)."""
        return _RemoteNamespace(self._remote)


class _RemoteNamespace(collections.abc.Mapping):
    """A remote module's globals, read one name at a time."""

    def __init__(self, remote: RemoteObject):
        self.remote = remote

    def __getitem__(self, name):
        try:
            return getattr(self.remote, name)
        except AttributeError:
            raise KeyError(name) from None

    def __iter__(self):
        return iter(self.remote.__dir__())

    def __len__(self):
        return len(self.remote.__dir__())


class _RemoteLoader(importlib.abc.Loader):
    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint

    def create_module(self, spec):
        return RemoteModule(spec.name, self.endpoint, self.endpoint.request("import", name=spec.name))

    def exec_module(self, module):
        pass


class _RemoteFinder(importlib.abc.MetaPathFinder):
    """Serves every module of the lesson packages as a RemoteModule."""

    def __init__(self, endpoint: Endpoint, packages: set[str], prefixes: tuple[str, ...]):
        self.endpoint, self.packages, self.prefixes = endpoint, packages, prefixes

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if top not in self.packages and not top.startswith(self.prefixes or ("\0",)):
            return None
        return importlib.machinery.ModuleSpec(fullname, _RemoteLoader(self.endpoint), is_package=True)


# ---------------------------------------------------------------- starting and serving

ENDPOINT: Endpoint | None = None  # this process's judge, when it is one
ROOT = pathlib.Path(__file__).resolve().parent.parent


def install(command: list[str], packages: set[str], prefixes: tuple[str, ...] = ()) -> Endpoint:
    """Start the worker (`command` + two fd numbers it reads and writes) and serve `packages`'
    imports from it. Lesson modules already imported here would have run the student's code:
    refused."""
    _refuse_lessons_imported(packages, prefixes)
    to_worker_r, to_worker_w = os.pipe()
    from_worker_r, from_worker_w = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != ENV}  # the worker judges nothing
    worker = subprocess.Popen([*command, str(to_worker_r), str(from_worker_w)], pass_fds=(to_worker_r, from_worker_w),
                               stdin=subprocess.DEVNULL, env=env)
    os.close(to_worker_r)
    os.close(from_worker_w)
    endpoint = Endpoint(Channel(os.fdopen(from_worker_r, "rb"), os.fdopen(to_worker_w, "wb")), "judge")
    endpoint.process = worker
    sys.meta_path.insert(0, _RemoteFinder(endpoint, packages, prefixes))
    atexit.register(_stop_worker, endpoint)
    return endpoint


def attach(spec: dict, packages: set[str], prefixes: tuple[str, ...] = ()) -> Endpoint:
    """Serve `packages`' imports from a worker someone else started (the grader, as another user):
    its pipes are inherited here, `spec["fds"]` = [read, write]. This process cannot stop that
    worker; its starter does, when this process ends."""
    fds = spec.get("fds")
    if not (isinstance(fds, list) and len(fds) == 2 and all(isinstance(fd, int) for fd in fds)):
        raise JudgeError(f'{ENV}: "fds" must be two file descriptors, read and write')
    _refuse_lessons_imported(packages, prefixes)
    endpoint = Endpoint(Channel(os.fdopen(fds[0], "rb"), os.fdopen(fds[1], "wb")), "judge")
    sys.meta_path.insert(0, _RemoteFinder(endpoint, packages, prefixes))
    atexit.register(_stop_worker, endpoint)
    return endpoint


def _refuse_lessons_imported(packages: set[str], prefixes: tuple[str, ...]) -> None:
    already = sorted(name for name in sys.modules
                     if name.split(".")[0] in packages or name.startswith(prefixes or ("\0",)))
    if already:
        raise JudgeError(f"lesson modules were imported before the judge started: {already}")


def _stop_worker(endpoint: Endpoint) -> None:
    """Closing the channel ends the worker's loop; one that does not exit in 5 s is killed."""
    try:
        endpoint.channel.writer.close()
    except OSError:
        pass
    if endpoint.process is not None:
        try:
            endpoint.process.wait(5)
        except subprocess.TimeoutExpired:
            endpoint.process.kill()


@functools.cache
def lesson_packages() -> tuple[str, ...]:
    """Every `lN_<name>/` package at the repository's root, in lesson order."""
    packages = [p.parent.name for p in ROOT.glob("l[0-9]*_*/__init__.py")]
    return tuple(sorted(packages, key=lambda name: int(name[1:].split("_")[0])))


def install_from_environment() -> Endpoint | None:
    """The judge for this process when KVCOURSE_JUDGE names the worker's command: the lesson
    packages and the tests' probes (tests/probes*.py) are served by the worker."""
    global ENDPOINT
    spec = os.environ.get(ENV)
    if not spec:
        return None
    command = json.loads(spec)
    if isinstance(command, dict):
        ENDPOINT = attach(command, set(lesson_packages()), prefixes=("probes",))
        return ENDPOINT
    if not (isinstance(command, list) and command and all(isinstance(c, str) for c in command)):
        raise JudgeError(f"{ENV} must be a JSON list of strings (the command that starts the worker) or an "
                         'object {"fds": [read, write]} (the pipes of a worker already started)')
    ENDPOINT = install(command, set(lesson_packages()), prefixes=("probes",))
    return ENDPOINT


def serve(read_fd: int, write_fd: int) -> None:
    """The worker's loop: answer the judge's requests until it closes the channel."""
    endpoint = Endpoint(Channel(os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")), "worker")
    sys.path.append(str(ROOT / "tests"))  # tests/probes*.py
    while True:
        try:
            message, blobs = endpoint.channel.recv()
        except JudgeError:
            return
        endpoint.serve(message, blobs)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
