"""How many conversations' K/V states fit: in the ANE's per-process budget and in host memory.

Plain functions over a manifest, below the daemon and the probes so both can use them: `serve`
chooses its default `--kv-slots` here and reports it at start and in /health, and `ane-spec
doctor` prints the same figures.

A slot holds one conversation's states for every shard: per layer a K and a V state of shape
[1, kv_heads, max_seq, head_dim], fp16 (the only state type Core ML has). Phi-4-mini at
max_seq 2048: 32 layers x 2 x 8 x 2048 x 128 x 2 bytes = 256 MiB per slot.

The ANE figure is an estimate, not a measured rule: the seed's Phi-4-mini run failed with error
-14 when about 3 GB of programs were loaded in one process (two shard sets), so resident states
are counted against ANE_PROCESS_BYTES; one conversation at a time fit there. Host memory bounds
the slots too (Core ML keeps each MLState in host memory), at HOST_SHARE of the machine's RAM.

A build with KV rings (sliding-window layers, model/swa_ring.py) declares its local layers'
states [1, kv_heads, W + 4, head_dim]: `state_bytes` reads the specs, so it counts the rings,
and `full_length_bytes` says what the same build would cost without them.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from ane_spec.manifests.schema import Manifest
from ane_spec.model.swa_ring import kv_state_bytes

ANE_PROCESS_BYTES = 3 * 10**9
STATE_ELEMENT_BYTES = 2  # fp16
HOST_SHARE = 1 / 8  # of physical memory, for resident states and again for spilled copies
MAX_DEFAULT_SLOTS = 4  # one accelerator serves one request at a time: a few warm conversations


def state_bytes(manifest: Manifest) -> int:
    """Bytes of one conversation's K/V states over all shards, from the states' TensorSpecs."""
    return sum(math.prod(int(d) for d in spec.shape) * STATE_ELEMENT_BYTES
               for shard in manifest.shards for spec in shard.states)


def full_length_bytes(manifest: Manifest) -> int:
    """What one conversation's states would take if every layer kept max_seq slots."""
    return kv_state_bytes(manifest.model, manifest.build.max_seq, 0)


def physical_memory_bytes() -> int | None:
    """The machine's RAM (Linux and macOS), or None where sysconf cannot tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class SlotBudget:
    state_bytes: int           # one slot, all shards (KV rings counted as built)
    ane_slots: int             # resident slots within ANE_PROCESS_BYTES
    host_slots: int | None     # resident slots within HOST_SHARE of RAM (None: RAM unknown)
    default_slots: int         # what `serve` uses without --kv-slots
    memory_bytes: int | None
    spill_bytes: int           # default host budget for spilled slots
    full_length_bytes: int = 0  # one slot without KV rings (= state_bytes without rings)

    def to_dict(self) -> dict:
        return asdict(self) | {"ane_budget_bytes": ANE_PROCESS_BYTES}

    def summary(self) -> str:
        host = ("RAM unknown" if self.host_slots is None else
                f"{self.host_slots} in 1/{round(1 / HOST_SHARE)} of {_gib(self.memory_bytes)} RAM")
        rings = (f" ({_mib(self.full_length_bytes)} without its KV rings)"
                 if self.full_length_bytes > self.state_bytes else "")
        return (f"K/V state {_mib(self.state_bytes)} per slot{rings}: {self.ane_slots} resident slots "
                f"fit the ~{ANE_PROCESS_BYTES / 1e9:.0f} GB per-process ANE budget, {host}; "
                f"default --kv-slots {self.default_slots}")


def slot_budget(manifest: Manifest, memory_bytes: int | None = None) -> SlotBudget:
    per_slot = max(1, state_bytes(manifest))
    memory = physical_memory_bytes() if memory_bytes is None else memory_bytes
    ane = ANE_PROCESS_BYTES // per_slot
    host = None if memory is None else int(memory * HOST_SHARE) // per_slot
    default = max(1, min(ane, MAX_DEFAULT_SLOTS, MAX_DEFAULT_SLOTS if host is None else host))
    spill = 0 if memory is None else int(memory * HOST_SHARE)
    return SlotBudget(per_slot, ane, host, default, memory, spill, full_length_bytes(manifest))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"
