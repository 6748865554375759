"""Write damaged copies of a GGUF file, for the error-path tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter


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
