"""``GGUFFile``: the tensor table and the scalar metadata of a GGUF file, read in milliseconds.

The ``gguf`` package's reader builds a numpy view for every part of every metadata field, and a
model's vocabulary is metadata: SmolLM2's 49,152 tokens and 48,900 merges made ~500,000 views and
took ~2.4 s on the 2-core VM, twice a load (once to check the tensor types, once to read them).
The engine needs only the tensor table, a few scalars (the architecture, the alignment) and the
chat template, so this reader steps over arrays by their lengths and keeps every other value.
The weights themselves are not read here: ``raw`` maps them from the file.

The layout (GGUF versions 2 and 3, little-endian), every count a uint64:

    "GGUF" | version u32 | tensor count | metadata count
    metadata:  key (string) | value type u32 | value           string = length + UTF-8 bytes
    tensors:   name (string) | n_dims u32 | dims (ne[0] first, the fastest-moving) | ggml type u32 | offset
    padding to ``general.alignment`` (32 unless the metadata says otherwise), then the data; a
    tensor's bytes start at the data's start + its offset.

Worked example, a Q4_1 projection of 576 inputs and 192 outputs: dims (576, 192), so numpy's
shape is (192, 576) and each row is 576 / 32 = 18 blocks of 20 bytes: ``raw`` gives [192, 360]
uint8.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Metadata value types: the struct format of each fixed-size one.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader can parse (bad magic, an old version, truncated)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # the ggml type's name, e.g. "Q4_1", "F32"
    shape: tuple[int, ...]  # numpy order: the slowest-moving dimension first
    data_offset: int  # absolute, in the file
    nbytes: int


class GGUFFile:
    """``metadata``: every non-array value by key; ``tensors``: the tensor table, in file order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")  # [file bytes]
        self._pos = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise GGUFFormatError(f"truncated or malformed at byte {self._pos} ({e})") from e

    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as stored, mapped from the file (read-only): [rows, bytes per row]
        uint8 for a block-quantized type (a 2-D tensor's rows are its output features), the
        elements themselves for a float type."""
        data = self._map[tensor.data_offset:tensor.data_offset + tensor.nbytes]
        kind = GGMLQuantizationType[tensor.type_name]
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return data.view(np.float32 if kind == GGMLQuantizationType.F32 else np.float16).reshape(tensor.shape)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        return data.reshape(*tensor.shape[:-1], tensor.shape[-1] // block * block_bytes)

    # --- parsing -------------------------------------------------------------------------------

    def _parse(self) -> None:
        if bytes(self._map[:4]) != b"GGUF":
            raise GGUFFormatError("bad magic bytes (not a GGUF file)")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version}; this reader reads versions 2 and 3")
        num_tensors, num_metadata = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict[str, object] = {}
        for _ in range(num_metadata):
            key = self._string()
            value = self._value(self._unpack("<I"))
            if value is not None:
                self.metadata[key] = value
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]  # ne[0] first
            infos.append((name, self._unpack("<I"), tuple(reversed(dims)), self._unpack("<Q")))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment  # rounded up
        self.tensors: list[GGUFTensor] = []
        for name, type_id, shape, offset in infos:
            try:
                kind = GGMLQuantizationType(type_id)
            except ValueError:
                raise GGUFFormatError(f"tensor {name} has unknown ggml type {type_id}") from None
            block, block_bytes = GGML_QUANT_SIZES[kind]
            nbytes = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
            start = data_start + offset
            if start + nbytes > len(self._map):
                raise GGUFFormatError(f"tensor {name} runs past the end of the file (truncated)")
            self.tensors.append(GGUFTensor(name, kind.name, shape, start, nbytes))

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        end = self._pos + n
        if end > len(self._map):
            raise GGUFFormatError(f"a string of {n} bytes at byte {self._pos} runs past the end of the file")
        text = bytes(self._map[self._pos:end]).decode("utf-8")
        self._pos = end
        return text

    def _value(self, value_type: int):
        """The value at the cursor (None for an array, stepped over without being read)."""
        if value_type in _SCALAR:
            return self._unpack(_SCALAR[value_type])
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type in _SCALAR:
                self._pos += struct.calcsize(_SCALAR[item_type]) * count
            elif item_type == _STRING:
                for _ in range(count):
                    length = self._unpack("<Q")  # (not ``_pos += _unpack(...)``: the cursor is read first)
                    self._pos += length
            else:  # arrays of arrays: step over each
                for _ in range(count):
                    self._value(item_type)
            if self._pos > len(self._map):
                raise GGUFFormatError("an array runs past the end of the file (truncated)")
            return None
        raise GGUFFormatError(f"unknown metadata value type {value_type} at byte {self._pos}")
