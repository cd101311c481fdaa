"""Stream a model's (HF name, tensor) pairs one decoder layer at a time, for a weight sync into vLLM.

vLLM rebuilds each fused weight (q/k/v -> qkv_proj, gate/up -> gate_up_proj) only from the tensors given
in one reload call, so a sync's bucket must hold whole decoder layers (docs/PLATFORM_NOTES.md, vLLM weight
sync). The hybrid engine (training/engine/hybrid.py) packs these layer groups into its buckets; the HF export
(training/engine/hf_export.py) gathers ZeRO-3 shards a layer at a time with them.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
"""Matches a decoder layer's tensor name; group 1 is the layer's index."""


def group_by_layer(named_tensors: Iterable[tuple[str, Any]]) -> Iterator[list[tuple[str, Any]]]:
    """Split (name, tensor) pairs into one bucket per decoder layer, plus one per run of non-layer tensors.

    vLLM rebuilds each fused weight (q/k/v -> qkv_proj, gate/up -> gate_up_proj) only from
    the tensors given in one reload call, so a bucket must hold whole decoder layers; this
    keeps that true while streaming. Input must list each layer's tensors contiguously
    (as named_parameters() does); a layer that shows up again after its bucket was sent
    raises ValueError instead of silently splitting a fused group.
    """
    seen: set[str] = set()
    bucket: list[tuple[str, Any]] = []
    key = None
    for name, t in named_tensors:
        m = LAYER_RE.search(name)
        k = f"layer{m.group(1)}" if m else "other"
        if k != key:
            if bucket:
                yield bucket
                if key != "other":
                    seen.add(key)
            if k in seen:
                raise ValueError(
                    f"tensor {name!r} belongs to decoder {k}, whose bucket was already sent; "
                    "pass each layer's tensors contiguously (e.g. in named_parameters() order)"
                )
            bucket, key = [], k
        bucket.append((name, t))
    if bucket:
        yield bucket
