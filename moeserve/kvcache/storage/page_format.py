"""One stored page in bytes: a fixed header, the dtype and shape, a checksum, the tensor's raw bytes.

    magic "MSKV" | version u16 | meta length u32 | payload length u64 | crc32 u32 | meta | payload
    meta = dtype name (ascii) "\\0" dims (u64 each); crc32 covers the key, the meta and the payload

A page read back is checked whole: magic, version, lengths against the bytes actually there (a truncated file), the
dtype and shape against the payload length, and the checksum (a flipped byte, or a page stored under another key).
"""

from __future__ import annotations

import struct
import zlib

import torch

MAGIC = b"MSKV"
VERSION = 1
_HEADER = struct.Struct("<4sHIQI")
HEADER_BYTES = _HEADER.size
_DTYPES = {str(dt).removeprefix("torch."): dt for dt in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


class CorruptPage(ValueError):
    """A stored page whose bytes do not check out; its reader treats it as a miss."""


def encode_page(key: str, tensor: torch.Tensor) -> bytes:
    """The stored form of `tensor` (any shape; one of _DTYPES; moved to the CPU) under `key`."""
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"cannot store a page of dtype {tensor.dtype}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    payload = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    meta = page_meta(tensor.dtype, tensor.shape)
    return _HEADER.pack(MAGIC, VERSION, len(meta), len(payload), _crc(key, meta, payload)) + meta + payload


def page_meta(dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> bytes:
    """The meta field of a page of this dtype and shape (what a reader expecting that page compares)."""
    return str(dtype).removeprefix("torch.").encode() + b"\0" + struct.pack(f"<{len(shape)}Q", *shape)


def check_parts(key: str, head: bytes | bytearray | memoryview, payload: memoryview) -> None:
    """A page read in two parts, head (the header and the meta the reader expects: HEADER_BYTES + its length)
    and payload (the rest): CorruptPage unless the header's magic, version and lengths match the parts and the
    checksum covers them. The caller compares head's meta with the one it expects."""
    magic, version, meta_len, payload_len, crc = _HEADER.unpack_from(head)
    _check_magic(magic, version)
    if meta_len != len(head) - HEADER_BYTES or payload_len != len(payload):
        raise CorruptPage(f"the header says {meta_len} + {payload_len} bytes, the page has "
                          f"{len(head) - HEADER_BYTES} + {len(payload)}")
    if _crc(key, memoryview(head)[HEADER_BYTES:], payload) != crc:
        raise CorruptPage("checksum mismatch")


def _crc(key: str, meta: bytes | memoryview, payload: bytes | memoryview) -> int:
    """The checksum of a page: its key, meta and payload."""
    return zlib.crc32(payload, zlib.crc32(meta, zlib.crc32(key.encode())))


def _check_magic(magic: bytes, version: int) -> None:
    if magic != MAGIC:
        raise CorruptPage(f"bad magic {magic!r}")
    if version != VERSION:
        raise CorruptPage(f"format version {version}, this reader knows {VERSION}")


def decode_page(key: str, data: bytes | bytearray | memoryview) -> torch.Tensor:
    """The tensor stored by encode_page(key, ...) in `data`; CorruptPage saying what is wrong otherwise."""
    if len(data) < HEADER_BYTES:
        raise CorruptPage(f"{len(data)} bytes, shorter than the header")
    magic, version, meta_len, payload_len, crc = _HEADER.unpack_from(data)
    _check_magic(magic, version)
    if len(data) != HEADER_BYTES + meta_len + payload_len:
        raise CorruptPage(f"{len(data)} bytes, the header says {HEADER_BYTES + meta_len + payload_len}")
    view = memoryview(data)
    meta = view[HEADER_BYTES:HEADER_BYTES + meta_len]
    payload = view[HEADER_BYTES + meta_len:]
    if _crc(key, meta, payload) != crc:
        raise CorruptPage("checksum mismatch")
    name, sep, dims = bytes(meta).partition(b"\0")
    dtype = _DTYPES.get(name.decode("ascii", "replace"))
    if not sep or dtype is None or len(dims) % 8:
        raise CorruptPage(f"bad dtype or shape field {bytes(meta)!r}")
    shape = struct.unpack(f"<{len(dims) // 8}Q", dims)
    numel = 1
    for d in shape:
        numel *= d
    itemsize = dtype.itemsize
    if numel * itemsize != payload_len:
        raise CorruptPage(f"shape {shape} of {dtype} needs {numel * itemsize} bytes, the payload has {payload_len}")
    if payload_len == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(data, bytearray):  # a reader's own buffer: the tensor shares it, no copy
        raw = torch.frombuffer(data, dtype=torch.uint8, offset=HEADER_BYTES + meta_len, count=payload_len)
    else:
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
