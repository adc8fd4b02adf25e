"""What can be measured about a model file set without running it: sizes, tensor bytes, bits per weight."""

from __future__ import annotations

import json
import math
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import QuantforgeError

SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
MAX_HEADER = 100 * 1024 * 1024


def safetensors_header(path: Path) -> dict:
    """The parsed, validated JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets).

    Validation follows the format's rules: the header length fits the file, the JSON is an object, every tensor's
    byte range lies inside the data section and matches its dtype and shape, and ranges do not overlap.
    """
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise QuantforgeError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER or 8 + length > size:
            raise QuantforgeError(
                f"{path} is corrupted: its header length {length} does not fit the file ({size} bytes)"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise QuantforgeError(f"{path} is corrupted: its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise QuantforgeError(f"{path} is corrupted: its header is not a JSON object")
    data_size = size - 8 - length
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            expected = math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]
            valid = isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data_size
        except (KeyError, TypeError, ValueError):
            raise QuantforgeError(f"{path} is corrupted: tensor {name!r} has a malformed entry") from None
        if not valid or end - start != expected:
            raise QuantforgeError(f"{path} is corrupted: tensor {name!r} lies outside the file or has the wrong size")
        ranges.append((start, end))
    ranges.sort()
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        if start < end:
            raise QuantforgeError(f"{path} is corrupted: tensors overlap")
    return header


def _tensors(folder: Path):
    for file in sorted(folder.glob("*.safetensors")):
        for name, info in safetensors_header(file).items():
            if name != "__metadata__":
                yield name, info


def parameter_count(folder: Path) -> int:
    """Number of weights of an unquantized HF model, from its safetensors headers (no tensor is read)."""
    return sum(math.prod(info["shape"]) for _, info in _tensors(folder))


GGUF_MAGIC = b"GGUF"
# GGUF metadata value types of a fixed size (type id -> bytes); 8 is a string, 9 an array.
GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
GGUF_STRING, GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int  # from the start of the file


class _GGUFHeader:
    """A cursor over a GGUF file's header (version 2 or 3, little-endian) that reads no tensor data.

    gguf's own GGUFReader builds numpy views of every metadata value, 1.7-4.9 s for a file with a 49k-token
    vocabulary; walking past the values is a few milliseconds, and quantforge needs only the tensor table and a few
    scalar values.
    """

    def __init__(self, view, size: int):
        self.view, self.size, self.at = view, size, 0

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.view, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def skip(self, count: int) -> None:
        self.at += count
        if self.at > self.size:
            raise ValueError("header runs past the end of the file")

    def string(self) -> str:
        length = self.take("Q")
        self.skip(length)
        return bytes(self.view[self.at - length : self.at]).decode("utf-8")

    def value(self, kind: int):
        """A scalar or string value; arrays are skipped and read as None."""
        if kind in GGUF_SCALAR_FORMATS:
            return self.take(GGUF_SCALAR_FORMATS[kind])
        if kind == GGUF_STRING:
            return self.string()
        self.skip_value(kind)
        return None

    def skip_value(self, kind: int) -> None:
        if kind in GGUF_SCALAR_BYTES:
            self.skip(GGUF_SCALAR_BYTES[kind])
        elif kind == GGUF_STRING:
            self.skip(self.take("Q"))
        elif kind == GGUF_ARRAY:
            item, count = self.take("IQ")
            if item in GGUF_SCALAR_BYTES:
                self.skip(GGUF_SCALAR_BYTES[item] * count)
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise ValueError(f"unknown metadata type {kind}")


@contextmanager
def _gguf_header(path: Path):
    """The header cursor of a mapped GGUF file, past its preamble, with its tensor and metadata counts."""
    import mmap

    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
        header = _GGUFHeader(view, path.stat().st_size)
        _magic, version, tensor_count, kv_count = header.take("4sIQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}")
        yield header, tensor_count, kv_count


def _read_metadata(header: _GGUFHeader, kv_count: int, keys: set[str]) -> dict:
    """The scalar and string values of ``keys`` (arrays read as None); leaves the cursor past the metadata."""
    found = {}
    for _ in range(kv_count):
        name, kind = header.string(), header.take("I")
        if name in keys:
            found[name] = header.value(kind)
        else:
            header.skip_value(kind)
    return found


def _read_gguf_tensors(path: Path) -> list[GGUFTensor]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with _gguf_header(path) as (header, tensor_count, kv_count):
        alignment = _read_metadata(header, kv_count, {"general.alignment"}).get("general.alignment")
        alignment = alignment if isinstance(alignment, int) and alignment > 0 else 32
        table = []
        for _ in range(tensor_count):
            name, dims = header.string(), header.take("I")
            shape = tuple(header.take("Q") for _ in range(dims))
            kind, offset = header.take("IQ")
            table.append((name, shape, GGMLQuantizationType(kind), offset))
    data_start = -(-header.at // alignment) * alignment
    tensors = []
    for name, shape, kind, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        elements = math.prod(shape)
        if elements % block:
            raise ValueError(f"tensor {name} does not fill whole blocks")
        tensors.append(GGUFTensor(name, kind, shape, elements // block * block_bytes, data_start + offset))
    return tensors


def gguf_metadata_value(path: Path, key: str):
    """The scalar or string value of one GGUF metadata key (None when the file lacks it), read from the header
    alone. The file is assumed valid (``gguf_tensors`` checks that)."""
    with _gguf_header(path) as (header, _tensor_count, kv_count):
        return _read_metadata(header, kv_count, {key}).get(key)


def gguf_tensors(path: Path) -> list[GGUFTensor]:
    """The tensors of a GGUF file, or a one-line error when the file is not a complete, valid GGUF.

    A damaged file fails in many ways (struct, Unicode and value errors); all of them mean the same to a user.
    """
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise QuantforgeError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        tensors = _read_gguf_tensors(path)
        size = path.stat().st_size
        for tensor in tensors:
            if tensor.data_offset + tensor.n_bytes > size:
                raise ValueError("tensor data beyond the end of the file")
    except Exception as exc:  # noqa: BLE001 - any failure to parse is a damaged file
        raise QuantforgeError(
            f"{path} is a damaged or truncated GGUF file ({type(exc).__name__}); delete it and run the build again"
        ) from None
    return tensors


def tensor_bytes(path: Path) -> int:
    """Bytes of tensor data in a .gguf file, or in the safetensors files of a folder."""
    if path.suffix == ".gguf":
        return sum(int(tensor.n_bytes) for tensor in gguf_tensors(path))
    return sum(info["data_offsets"][1] - info["data_offsets"][0] for _, info in _tensors(path))


def measure(path: Path, reference_parameters: int) -> dict:
    """Size on disk and effective bits per weight over all tensors (scales, zero points and metadata included)."""
    from .fsutil import total_size

    data_bytes = tensor_bytes(path)
    return {
        "size_bytes": total_size(path),
        "tensor_bytes": data_bytes,
        "bits_per_weight": round(8 * data_bytes / reference_parameters, 4) if reference_parameters else None,
    }
