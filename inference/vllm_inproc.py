"""Several in-process vLLM engines in one process: dropping one must not tear down what the others share.

vLLM keeps its process groups (_WORLD, _TP, _PP, ...) in module globals that every in-process
engine of the process uses, and EngineCore.shutdown, run when an LLM is garbage-collected,
ends with cleanup_dist_env_and_memory(): it destroys all of them and the default
torch.distributed group. Every other live engine then fails each generate() with "pipeline
model parallel group is not initialized" (an in-process simulator on the session engine got
0 documents after test_rollout dropped its own engine), and DeepSpeed loses its group.
`share_inproc_core` routes each new engine's teardown through `SharedCoreShutdown`, which runs the
process-wide teardown only when the last engine goes and vLLM (not the caller) created the group.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

# In-process engine cores alive in this process, and whether vLLM (not the caller) created the
# default torch.distributed group they all share.
_INPROC = {"live": 0, "vllm_made_pg": False}


class SharedCoreShutdown:
    """Replaces an in-process EngineCore's shutdown: tears down this engine, never the state others share."""

    def __init__(self, shutdown: Any):
        self.shutdown, self.done = shutdown, False

    def __call__(self) -> None:
        if self.done:  # the client's finalizer and an explicit shutdown() may both call it
            return
        self.done = True
        _INPROC["live"] -= 1
        if _INPROC["live"] <= 0 and _INPROC["vllm_made_pg"]:
            self.shutdown()
            return
        import vllm.v1.engine.core as core_mod

        cleanup = core_mod.cleanup_dist_env_and_memory
        core_mod.cleanup_dist_env_and_memory = lambda *a, **k: gc.collect()
        try:
            self.shutdown()
        finally:
            core_mod.cleanup_dist_env_and_memory = cleanup


def share_inproc_core(llm: Any, pg_existed: bool) -> bool:
    """Route an in-process LLM's teardown through SharedCoreShutdown; False where vLLM's layout differs.

    pg_existed: whether torch.distributed was initialised before this LLM was created (by the caller).
    Multi-process clients (EngineCore in its own process) tear down only that process: left alone.
    """
    import vllm.v1.engine.core as core_mod

    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    core = getattr(client, "engine_core", None)
    fin = getattr(client, "_finalizer", None)
    if core is None or not isinstance(fin, weakref.finalize) or not hasattr(core_mod, "cleanup_dist_env_and_memory"):
        return False
    if _INPROC["live"] <= 0:
        _INPROC["live"], _INPROC["vllm_made_pg"] = 0, not pg_existed
    _INPROC["live"] += 1
    # An instance attribute shadows the method, so InprocClient.shutdown() takes this path too.
    core.shutdown = SharedCoreShutdown(core.shutdown)
    fin.detach()
    client._finalizer = weakref.finalize(client, core.shutdown)
    return True
