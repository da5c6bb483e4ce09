"""One file per rank, in the safetensors layout (written and read by this code; no pickle, so
opening a checkpoint cannot execute anything): 8 bytes little-endian header length N, N bytes
of JSON header {key: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}} padded
with spaces to a multiple of 8, then the raw bytes of every piece back to back.

Cost: writing streams each piece from its live array (a device piece is copied to the host first,
one piece at a time), so saving holds at most one extra piece in memory; a CRC-32 of every piece
(zlib, ~3 GB/s here) goes to the manifest. Reading one piece reads exactly its bytes, and checks them.
"""
import json
import os
import struct
import zlib

import numpy as np

from .. import backend
from ..backend import bfloat16

#: safetensors' dtype names
DTYPE_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
               "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "bfloat16": "BF16"}
_NUMPY = {code: name for name, code in DTYPE_CODES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as it should: the message names the file and the tensor."""


def numpy_dtype(name):
    return np.dtype(bfloat16) if name == "bfloat16" else np.dtype(name)


def dtype_name(dtype):
    name = np.dtype(dtype).name
    if name not in DTYPE_CODES:
        raise CheckpointError(f"dtype {name} cannot be stored in a checkpoint (supported: {sorted(DTYPE_CODES)})")
    return name


def _bytes_of(array):
    """The raw bytes of a host array (a view when it is contiguous: no copy)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def write_rank_file(path, pieces, metadata, fsync=True):
    """Write ``pieces`` (key -> array, numpy or cupy) to ``path``; returns {key: (begin, end, crc32)}
    (byte offsets in the data section) and the file's size."""
    header, offset = {"__metadata__": {k: str(v) for k, v in metadata.items()}}, 0
    for key, array in pieces:
        nbytes = int(array.size) * array.dtype.itemsize
        header[key] = {"dtype": DTYPE_CODES[dtype_name(array.dtype)], "shape": [int(d) for d in array.shape],
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    written = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key, array in pieces:
            host = backend.to_host(array)          # on CuPy: the deliberate device -> host copy of one piece
            data = _bytes_of(host)
            f.write(data)
            begin, end = header[key]["data_offsets"]
            written[key] = (begin, end, zlib.crc32(data))
            del host, data
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        size = f.tell()
    return written, size


def crc_hex(value):
    return f"{value & 0xFFFFFFFF:08x}"


class RankFile:
    """A rank's file opened for reading: the header parsed and checked against the manifest."""

    def __init__(self, path, expected_size):
        self.path = path
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is not a file")
        size = os.path.getsize(path)
        if expected_size is not None and size != expected_size:
            raise CheckpointError(f"checkpoint file {path} has {size} bytes, the manifest says {expected_size} "
                                  f"(truncated or overwritten)")
        try:
            self.file = open(path, "rb")
        except OSError as e:                      # no permission to read it
            raise CheckpointError(f"cannot read the checkpoint file {path}: {e.strerror or e}") from None
        try:
            (n,) = struct.unpack("<Q", self.file.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file")
            self.header = json.loads(self.file.read(n))
            if not isinstance(self.header, dict):
                raise ValueError("the header is not a JSON object")
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            self.file.close()
            raise CheckpointError(f"checkpoint file {path}: its header is unreadable ({e})") from None
        self.data_start = 8 + n

    def read(self, key, dtype, shape, data_offsets, crc):
        """The piece ``key`` as a host array, after checking the header and the CRC-32 of its bytes."""
        entry = self.header.get(key)
        want = {"dtype": DTYPE_CODES[dtype_name(dtype)], "shape": list(shape), "data_offsets": list(data_offsets)}
        if entry != want:
            raise CheckpointError(f"checkpoint file {self.path}: the header's entry for {key} is {entry}, "
                                  f"the manifest expects {want}")
        begin, end = data_offsets
        array = np.empty(shape, dtype)
        buffer = _bytes_of(array) if array.size else memoryview(bytearray(0))
        self.file.seek(self.data_start + begin)
        if self.file.readinto(buffer) != end - begin:
            raise CheckpointError(f"checkpoint file {self.path}: {key} is cut short")
        if crc_hex(zlib.crc32(buffer)) != crc:
            raise CheckpointError(f"checkpoint file {self.path}: tensor {key} fails its checksum "
                                  f"(CRC-32 {crc_hex(zlib.crc32(buffer))}, the manifest says {crc}): the file is corrupt")
        return array

    def close(self):
        self.file.close()


def fsync_directory(path):
    """Make a rename inside ``path`` durable (POSIX: the directory entry itself is data)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
