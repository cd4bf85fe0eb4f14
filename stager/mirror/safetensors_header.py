"""The safetensors header, parsed and validated without trusting the file.

Format: an 8-byte little-endian header length N, then N bytes of JSON: an object
mapping tensor names to {dtype, shape, data_offsets: [begin, end]} (offsets are
relative to the data that starts at 8 + N), plus an optional `__metadata__`.

Every field is checked before anything is read at an offset the file names: a
header length of 2**63 must not become a 2**63-byte read, and a tensor whose span
runs past the end of the file must not become a short read halfway through a
47 GiB pack.  The spans must tile the data as safetensors requires (no overlap, no gap).  Any
violation is `BadInput` naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from stager.base.errors import BadInput
from stager.sources.base import Reader

# Real headers are a few MiB at most (tens of thousands of tensors); a bigger one is corrupt.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# Bits per element, as the safetensors specification lists them.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    file: str  # how errors name the file
    file_size: int
    data_start: int
    tensors: dict[str, TensorInfo]

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise BadInput(f"{self.file}: tensor {name} is not in the safetensors header")
        return self.tensors[name]


def read_header(reader: Reader, file: str) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file open as `reader`."""
    size = reader.size
    if size < 8:
        raise BadInput(f"{file}: truncated safetensors header ({size} bytes, the length prefix alone is 8)")
    (length,) = struct.unpack("<Q", reader.pread(8, 0))
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise BadInput(f"{file}: safetensors header length {length} is impossible for a {size}-byte file "
                       f"(limit {MAX_HEADER_BYTES} bytes)")
    raw = reader.pread(length, 8)
    if len(raw) != length:
        raise BadInput(f"{file}: truncated safetensors header (read {len(raw)} of {length} bytes)")
    return parse_header(raw, file, size)


def parse_header(raw: bytes, file: str, file_size: int) -> SafetensorsHeader:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"{file}: safetensors header is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadInput(f"{file}: safetensors header is a JSON {type(doc).__name__}, expected an object")
    data_start = 8 + len(raw)
    tensors = {}
    for name, spec in doc.items():
        if name == "__metadata__":
            if not isinstance(spec, dict):
                raise BadInput(f"{file}: __metadata__ is not an object")
            continue
        tensors[name] = _tensor(name, spec, file, data_start, file_size)
    _refuse_untiled(tensors, file, data_start, file_size)
    return SafetensorsHeader(file, file_size, data_start, tensors)


def _refuse_untiled(tensors: dict[str, TensorInfo], file: str, data_start: int, file_size: int) -> None:
    """The tensors' spans, in offset order, must tile the data exactly: no overlap, no gap, nothing after.

    safetensors itself refuses any other file (InvalidOffset, MetadataIncompleteBuffer). Two tensors
    sharing bytes would pack rows that are also another tensor's data, and nothing else would
    ever notice, because every span on its own is inside the file and of the right size."""
    end, previous = data_start, None
    for tensor in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        offsets = [tensor.start - data_start, tensor.end - data_start]
        if tensor.start < end:
            raise BadInput(f"{file}: tensor {tensor.name}: data_offsets {offsets} overlap tensor {previous.name}, "
                           f"which ends at {end - data_start}")
        if tensor.start > end:
            after = f"tensor {previous.name} ends" if previous else "the data starts"
            raise BadInput(f"{file}: tensor {tensor.name}: data_offsets {offsets} leave a gap of "
                           f"{tensor.start - end} bytes after {after} at {end - data_start}")
        end, previous = tensor.end, tensor
    if end != file_size:
        last = f"the last tensor, {previous.name}, ends" if previous else "there are no tensors"
        raise BadInput(f"{file}: {file_size - end} bytes after the tensor data ({last} at byte {end} of the "
                       f"{file_size}-byte file)")


def _tensor(name: str, spec: object, file: str, data_start: int, file_size: int) -> TensorInfo:
    where = f"{file}: tensor {name}"
    if not isinstance(spec, dict):
        raise BadInput(f"{where}: entry is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise BadInput(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_natural(d) for d in shape):
        raise BadInput(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_natural(o) for o in offsets)
            or offsets[0] > offsets[1]):
        raise BadInput(f"{where}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        raise BadInput(f"{where}: {dtype} {shape} needs {bits / 8:g} bytes but data_offsets span "
                       f"{offsets[1] - offsets[0]}")
    start, end = data_start + offsets[0], data_start + offsets[1]
    if end > file_size:
        raise BadInput(f"{where}: data ends at byte {end}, past the end of the {file_size}-byte file")
    return TensorInfo(name, dtype, tuple(shape), start, end)


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
