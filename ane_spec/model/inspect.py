"""A human- and machine-readable summary of a GGUF file (`ane-spec inspect FILE`); a build
folder's summary reads its manifest, a layer up (manifests/inspect_build.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ane_spec.model.gguf_file import GGUFModel, optional_tensor_shapes
from ane_spec.model.swa_ring import kv_state_bytes, ring_rows, uses_ring
from ane_spec.model.tokenizer import Tokenizer


def describe(model: GGUFModel) -> dict[str, Any]:
    tok = Tokenizer.from_data(model.tokenizer_data)
    types = Counter(t.type_name for t in model.tensors.values())
    matrices = Counter(t.type_name for t in model.tensors.values() if len(t.shape) > 1)
    data = model.tokenizer_data
    return kv_rings(model.config) | {
        "path": str(model.path),
        "file_bytes": model.path.stat().st_size,
        "architecture": {"name": model.config.arch, "title": model.config.architecture.title,
                         "quirks": list(model.config.architecture.quirks),
                         "rope_type": model.config.architecture.rope_type,
                         "rope_factor_tensors": sorted(
                             n for n in optional_tensor_shapes(model.config)
                             if n in model.tensors)},
        "config": model.config.model_dump(),
        "parameters": model.config.num_parameters(),
        "file_type": model.file_type_name,
        "tensors": {"count": len(model.tensors), "types": dict(sorted(types.items())),
                    "matrix_types": dict(sorted(matrices.items())),
                    "bytes": sum(t.nbytes for t in model.tensors.values())},
        "tokenizer": {
            "model": data.model, "pre": data.pre, "vocab_size": tok.vocab_size,
            "merges": len(data.merges),
            "special_tokens": sum(1 for t in data.token_types if t in (3, 4)),
            "eog_ids": sorted(tok.eog_ids),
            "chat_template": "from GGUF" if data.chat_template else "built-in Phi-4-mini",
            "add_bos": data.add_bos_token,
        },
    }


def kv_rings(c: Any, max_t: int = 4) -> dict[str, Any]:
    """For a model with sliding-window layers: one conversation's K/V bytes at its full context
    with KV rings on the local layers (what `build` makes) and without."""
    if not (c.has_local_layers and uses_ring(c.sliding_window, max_t, c.context_length)):
        return {}
    ring = ring_rows(c.sliding_window, max_t)
    return {"kv_state": {"context": c.context_length, "ring": ring,
                         "bytes_ring": kv_state_bytes(c, c.context_length, ring),
                         "bytes_full": kv_state_bytes(c, c.context_length, 0)}}


def format_description(d: dict[str, Any]) -> str:
    c = d["config"]
    a = d["architecture"]
    lines = [
        f"{d['path']}  ({d['file_bytes'] / 1e6:,.1f} MB, {d['parameters'] / 1e9:.3f}B params)",
        f"  architecture {a['name']} ({a['title']}): " + "; ".join(a["quirks"])
        + f"; RoPE {a['rope_type'].upper()}, factor tensors: "
        + (", ".join(a["rope_factor_tensors"]) or "none"),
        f"  layers {c['num_layers']}, hidden {c['hidden_size']}, heads {c['num_heads']}/"
        f"{c['num_kv_heads']} kv, head_dim {c['head_dim']}, rotary {c['rope_dims']}, "
        f"ffn {c['ffn_size']}, vocab {c['vocab_size']}",
        f"  context {c['context_length']} (original {c['original_context_length']}), "
        f"rope base {c['rope_freq_base']:g}, attn factor {c['rope_attn_factor']:.7f}, "
        f"rms eps {c['rms_eps']:g}, {'tied' if c['tied_embeddings'] else 'separate'} LM head",
        f"  file type {d['file_type']}; tensors: {d['tensors']['count']} "
        + ", ".join(f"{k} x{v}" for k, v in d["tensors"]["types"].items())
        + f", {d['tensors']['bytes'] / 1e6:,.1f} MB",
    ]
    if c.get("sliding_window"):
        local = [i for i, f in enumerate(c["swa_layers"]) if f]
        lines.insert(4, f"  sliding window {c['sliding_window']} on {len(local)} of "
                        f"{c['num_layers']} layers (global: "
                        f"{[i for i, f in enumerate(c['swa_layers']) if not f]}), local rope "
                        f"base {c['rope_freq_base_swa']:g} unscaled; global rope scale "
                        f"{c['rope_freq_scale']:g}")
    if "kv_state" in d:
        k = d["kv_state"]
        lines.insert(5, f"  K/V per conversation at context {k['context']}: "
                        f"{k['bytes_ring'] / 2**20:,.1f} MiB with {k['ring']}-slot rings on the "
                        f"local layers, {k['bytes_full'] / 2**20:,.1f} MiB full-length")
    t = d["tokenizer"]
    lines.append(f"  tokenizer: {t['model']}/{t['pre']}, {t['vocab_size']} tokens, "
                 f"{t['merges']} merges, {t['special_tokens']} special, eog {t['eog_ids']}, "
                 f"{'BOS added' if t['add_bos'] else 'no BOS'}, "
                 f"chat template {t['chat_template']}")
    return "\n".join(lines)
