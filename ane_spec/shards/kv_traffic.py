"""Bytes of K/V state one pass moves to store its new rows, in each write form (`--kv-write`).

The scatter form (layer_graph.scatter_rows) computes `state * keep + W @ rows` over every slot:
each pass reads every layer's whole K and V state and writes it all back. The slice form
(layer_graph.window_rows) reads and writes one window per layer, as wide as the program's pass
(4 slots for the decode program, P for the prefill function), two on a ring layer. Both forms
then read the whole updated state once more for attention (q K^T and the weighted sum of V run
over every slot); that read is the same in both and is counted apart.

These are the bytes the programs ask for. What a device moves (whether Core ML updates a state
in place on slice_update, or fuses the scatter's read into the attention's) only a measurement
on the device can say.
"""

from __future__ import annotations

from dataclasses import dataclass

from ane_spec.model.config import ModelConfig
from ane_spec.model.swa_ring import kv_state_bytes
from ane_spec.shards.programs import KVWrite

FP16_BYTES = 2


@dataclass(frozen=True)
class KVTraffic:
    """One pass, every layer, K and V together."""

    write_read: int      # state bytes the K/V write reads
    write_written: int   # state bytes it writes
    attention_read: int  # state bytes attention reads (the same in both forms)

    @property
    def write_total(self) -> int:
        return self.write_read + self.write_written


def kv_traffic(c: ModelConfig, max_seq: int, kv_write: KVWrite, window: int,
               ring: int = 0) -> KVTraffic:
    """The traffic of one pass of a program whose slice window is `window` slots (its pass
    width: programs.kv_write_window), over states of `max_seq` slots (`ring` on local layers)."""
    whole = kv_state_bytes(c, max_seq, ring)
    if kv_write == "scatter":
        return KVTraffic(whole, whole, whole)
    per_slot = 2 * c.num_kv_heads * c.head_dim * FP16_BYTES  # K and V of one slot
    windows = sum(2 if ring and c.is_local(i) else 1 for i in range(c.num_layers))
    touched = per_slot * windows * window
    return KVTraffic(touched, touched, whole)


def format_bytes(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"
