"""Write damaged copies of a GGUF file, for the error-path and fuzz tests."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter


def rewrite_gguf(src: Path, dst: Path, *, arch: str = "phi3",
                 drop_tensors: tuple[str, ...] = (), drop_keys: tuple[str, ...] = (),
                 set_keys: dict[str, tuple[Any, GGUFValueType]] | None = None,
                 tensor_override: Callable[[str, np.ndarray, GGMLQuantizationType],
                                           tuple[np.ndarray, GGMLQuantizationType] | None]
                 | None = None) -> Path:
    """Copy `src` to `dst` with keys/tensors dropped or replaced.

    `tensor_override(name, data, type)` may return new (data, type) for a tensor; data for
    quantized types is the raw uint8 byte array, as gguf-py stores it.
    """
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, arch)
    set_keys = set_keys or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        if key in set_keys:
            continue
        vtype = field.types[0]
        value = field.contents()
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for key, (value, vtype) in set_keys.items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        data, qtype = np.array(t.data), t.tensor_type
        if tensor_override is not None:
            replaced = tensor_override(t.name, data, qtype)
            if replaced is not None:
                data, qtype = replaced
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# --- the byte layout of a well-formed file, for targeted corruption ---------------------------

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True)
class Field:
    """One structural field of a GGUF file: where it is, how wide, what it counts or tags."""

    offset: int
    size: int
    kind: str   # tensor_count, kv_count, string_len, value_type, array_type, array_count,
    #             n_dims, dim, ggml_type, tensor_offset
    owner: str  # the key or tensor it belongs to


@dataclass(frozen=True)
class Layout:
    fields: list[Field]
    boundaries: list[int]                      # start of every structure, and the end
    tensor_data: dict[str, tuple[int, int, int]]  # name -> (absolute offset, nbytes, ggml type)
    data_offset: int
    metadata_end: int                          # where the tensor directory starts
    alignment: int


def gguf_layout(data: bytes) -> Layout:
    """Walk a well-formed GGUF (as gguf_format does) and record every field and boundary."""
    pos = 0
    fields: list[Field] = []
    bounds: list[int] = []

    def u(fmt: str, kind: str | None = None, owner: str = "") -> int:
        nonlocal pos
        size = struct.calcsize(fmt)
        if kind:
            fields.append(Field(pos, size, kind, owner))
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += size
        return v

    def string(owner: str) -> str:
        nonlocal pos
        n = u("<Q", "string_len", owner)
        s = data[pos:pos + n].decode("utf-8", "replace")
        pos += n
        return s

    pos = 8
    n_tensors = u("<Q", "tensor_count")
    n_kv = u("<Q", "kv_count")
    alignment = 32
    for _ in range(n_kv):
        bounds.append(pos)
        key = string("key")
        vtype = u("<I", "value_type", key)
        bounds.append(pos)
        if vtype == 9:
            etype = u("<I", "array_type", key)
            count = u("<Q", "array_count", key)
            for _ in range(count):
                if etype == 8:
                    string(key)
                else:
                    pos += struct.calcsize(_SCALAR_FORMATS[etype])
        elif vtype == 8:
            string(key)
        else:
            value = u(_SCALAR_FORMATS[vtype])
            if key == "general.alignment":
                alignment = value
    metadata_end = pos
    infos = []
    for _ in range(n_tensors):
        bounds.append(pos)
        name = string("tensor name")
        n_dims = u("<I", "n_dims", name)
        dims = [u("<Q", "dim", name) for _ in range(n_dims)]
        gtype = u("<I", "ggml_type", name)
        offset = u("<Q", "tensor_offset", name)
        infos.append((name, dims, gtype, offset))
    bounds.append(pos)
    data_offset = -(-pos // alignment) * alignment
    tensors = {}
    for name, dims, gtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
        nbytes = int(np.prod(dims)) // block * type_size
        tensors[name] = (data_offset + offset, nbytes, gtype)
        bounds.append(data_offset + offset)
    bounds.append(len(data))
    return Layout(fields, sorted(set(bounds)), tensors, data_offset, metadata_end, alignment)


def set_field(data: bytes, f: Field, value: int) -> bytes:
    """`data` with field `f` overwritten by `value` (unsigned, as wide as the field)."""
    raw = value.to_bytes(f.size, "little")
    return data[:f.offset] + raw + data[f.offset + f.size:]


def insert_kv(data: bytes, key: str, vtype: int, payload: bytes) -> bytes:
    """`data` with one more key/value pair, the kv count updated and everything after shifted
    by a multiple of the alignment, so the tensor data stays where the directory says."""
    layout = gguf_layout(data)
    body = struct.pack("<I", vtype) + payload
    # Pad the key so that the inserted bytes are a whole number of alignment units.
    pad = -(8 + len(key.encode()) + len(body)) % layout.alignment
    name = key.encode() + b"_" * pad
    kv = struct.pack("<Q", len(name)) + name + body
    count = next(f for f in layout.fields if f.kind == "kv_count")
    n_kv = struct.unpack_from("<Q", data, count.offset)[0]
    data = set_field(data, count, n_kv + 1)
    return data[:layout.metadata_end] + kv + data[layout.metadata_end:]

