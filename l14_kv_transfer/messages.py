"""The messages the two ranks exchange per request, over torch.distributed (gloo, matched by tag):
a header of eight int64s, the prompt's ids, the keys of its full blocks, and the decode side's
one-number reply. Provided, not graded; transport.py runs them on its threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .tiers import KEY_BYTES

PREFILL_RANK, DECODE_RANK = 0, 1
HEADER, REPLY, PAYLOAD_BASE = 0, 1, 100  # tags; a payload's tag is PAYLOAD_BASE + the request's index
KIND_END, KIND_REQUEST = 0, 1
HEADER_LEN = 8
REFUSED = -1  # the decode side's reply when the request can never fit its pool
NOT_NOW = -2  # its reply when the request does not fit now: ask again later (backpressure, not an error)


class PeerLostError(RuntimeError):
    """The other rank closed the connection or did not answer in time."""


class TransferError(RuntimeError):
    """What arrived for a request is not what its header announced."""


@dataclass
class Header:
    index: int
    prompt_ids: list[int]
    first_token: int
    num_blocks: int  # blocks holding the prompt's K/V, the partial last one included
    keys: list[bytes]  # keys of its full blocks
    finished: bool  # the first token ended it (eos, or max_new_tokens 1): no K/V to send
    max_new_tokens: int


def send_header(h: Header, peer: int) -> None:
    dist.send(torch.tensor([KIND_REQUEST, h.index, len(h.prompt_ids), h.first_token, h.num_blocks, len(h.keys),
                            int(h.finished), h.max_new_tokens], dtype=torch.int64), peer, tag=HEADER)
    dist.send(torch.tensor(h.prompt_ids, dtype=torch.int64), peer, tag=HEADER)
    if h.keys:
        dist.send(torch.frombuffer(bytearray(b"".join(h.keys)), dtype=torch.uint8), peer, tag=HEADER)


def send_end(peer: int) -> None:
    dist.send(torch.zeros(HEADER_LEN, dtype=torch.int64), peer, tag=HEADER)


def recv_header(peer: int) -> Header | None:
    """The next header, or None at the end of the stream."""
    head = torch.zeros(HEADER_LEN, dtype=torch.int64)
    dist.recv(head, peer, tag=HEADER)
    kind, index, prompt_len, first, num_blocks, num_keys, finished, max_new = head.tolist()
    if kind == KIND_END:
        return None
    ids = torch.zeros(prompt_len, dtype=torch.int64)
    dist.recv(ids, peer, tag=HEADER)
    keys = []
    if num_keys:
        raw = torch.zeros(num_keys * KEY_BYTES, dtype=torch.uint8)
        dist.recv(raw, peer, tag=HEADER)
        data = raw.numpy().tobytes()
        keys = [data[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(num_keys)]
    return Header(index, ids.tolist(), first, num_blocks, keys, bool(finished), max_new)


def ask(header: Header, peer: int) -> int:
    """Send `header` and wait for the decode side's reply: blocks it holds, REFUSED or NOT_NOW.
    A finished header gets no reply (nothing will follow it): 0."""
    send_header(header, peer)
    if header.finished:
        return 0
    reply = torch.zeros(1, dtype=torch.int64)
    dist.recv(reply, peer, tag=REPLY)
    return int(reply)
