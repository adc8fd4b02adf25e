"""What can be measured about a model file set without running it: sizes, tensor bytes, bits per weight."""

from __future__ import annotations

import json
import math
import struct
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


def gguf_tensors(path: Path) -> list:
    """The tensors of a GGUF file, or a one-line error when the file is not a complete, valid GGUF.

    The gguf package raises many kinds of errors on damaged files (ValueError, IndexError, struct and numpy
    errors); all of them mean the same thing to a user.
    """
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise QuantforgeError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        tensors = list(reader.tensors)
        size = path.stat().st_size
        for tensor in tensors:
            if int(tensor.data_offset) + int(tensor.n_bytes) > size:
                raise ValueError("tensor data beyond the end of the file")
    except QuantforgeError:
        raise
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
