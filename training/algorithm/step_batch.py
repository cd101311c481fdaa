"""A step's trajectories packed once: the micro-batches every forward and update of the step reuses.

    batch = StepBatch(trajs, micro_token_budget)          # packed on first use: one all-reduce (equal counts)
    batch.put_packed(OLD, [fwd(mb) for mb in batch.micro_batches])   # forwards write their packed rows
    batch.put_packed(REF, ...); critic's values likewise (VALUES)
    adv = per-trajectory advantages from batch.column(OLD), ...      # read back as per-trajectory views
    batch.put(ADV, adv)                                   # scattered into the packed rows once
    ppo_update(..., batch=batch)                          # the mini-batch's micro-batches: batch.view(...)

The per-token columns sit in each MicroBatch's `tensors`, under the names the losses read: OLD
"old_logprobs", REF "ref_logprobs", VALUES "old_values" (the critic's values before its update), ADV
"advantages", RETURNS "returns" (the critic's targets); beside the packing's own "loss_mask" and
"rollout_logprobs". A column is absent until it is known (policy_loss reads "ref_logprobs" only when
there is a reference). Equalising dummies carry zeros in every column, as pack_equal gave them.

Mini-batches and roles (the design choice). An optimizer step's micro-batches must hold only its
mini-batch's trajectories (and, with --update_mode sequential, its role's). We pack a selection once
per *selection key*, not by selecting rows out of the whole step's micro-batches:
- the whole step (--ppo_mini_batches 1, --update_mode combined, the defaults) is the batch itself,
  in every epoch: split_mini_batches(n=1) returns every trajectory whatever its seed;
- --ppo_mini_batches 1 with --update_mode sequential: one selection per role, packed in the first
  epoch and reused by the others (the role's trajectories do not change with the epoch);
- several mini-batches: split_mini_batches deals groups with a seed that changes every epoch, so a
  mini-batch of one epoch is not one of the next; each (epoch, mini-batch, role) is packed when it
  is trained, exactly as before, with its columns gathered from the per-trajectory views.
Repacking from already packed rows would have changed the bins (so the summation order, so the
bits of the gradient) for no gain where the default already packs once; packing a selection with
pack_trajectories keeps every micro-batch identical to what the trainer built before.
Whether a selection is the whole batch or a cached one is decided from the config, never from this
rank's indices: each packing all-reduces its micro-batch count, so every rank must pack the same
selections (a rank whose selection happened to be all of its trajectories would otherwise skip an
all-reduce that the others make, and hang them).

The critic packs only the trajectories of its gae roles: the whole batch when every role uses gae,
otherwise the selection keyed "critic" (its values forward and, with one mini-batch, its update).
The teacher's sequences differ from the student's (another prompt), so they keep their own packing
(training/algorithm/teacher.py, training/algorithm/self_distill.py).

`pack_seconds` is the wall-clock time spent packing (and equalising) this step, selections
included: the trainer logs it as timing_s/pack (bench/bench_pack.py compares it with the
pack-per-phase sequence it replaces).
"""

from __future__ import annotations

import time
from typing import Hashable, Sequence

import torch

from training.algorithm.packing import MicroBatch, equalise_micro_batches, pack_trajectories, unpack_to_sequences
from utils import dist as D

OLD, REF, VALUES, ADV, RETURNS = "old_logprobs", "ref_logprobs", "old_values", "advantages", "returns"
BASE_KEYS = ("loss_mask", "rollout_logprobs")


class StepBatch:
    """Trajectories packed once into micro-batches equalised over ranks, with per-token columns.

    trajs: the trajectories (inference.trajectory.Trajectory) in the caller's order; a column's
    per-trajectory lists follow that order. Packing is lazy (the first `micro_batches`) and
    collective: every rank must reach it, as with pack_equal."""

    def __init__(self, trajs: Sequence, micro_token_budget: int, *, all_reduce_max=None, _clock: list | None = None):
        self.trajs = list(trajs)
        self.micro_token_budget = int(micro_token_budget)
        self._all_reduce_max = all_reduce_max or (lambda v: int(D.all_reduce_max(v)))
        self._clock = _clock if _clock is not None else [0.0]   # shared with the selections
        self._mbs: list[MicroBatch] | None = None
        self._n_real = 0
        self._views: dict[Hashable, StepBatch] = {}

    def __len__(self) -> int:
        return len(self.trajs)

    @property
    def pack_seconds(self) -> float:
        """Seconds spent packing this batch and its selections so far."""
        return self._clock[0]

    @property
    def micro_batches(self) -> list[MicroBatch]:
        """The equalised micro-batches (dummies last); packed on first access (collective)."""
        if self._mbs is None:
            t0 = time.perf_counter()
            mbs = pack_trajectories(self.trajs, self.micro_token_budget) if self.trajs else []
            self._n_real = len(mbs)
            self._mbs = equalise_micro_batches(mbs, self._all_reduce_max, per_token_keys=list(BASE_KEYS))
            self._clock[0] += time.perf_counter() - t0
        return self._mbs

    @property
    def num_real(self) -> int:
        """Micro-batches that hold trajectories (the rest are equalising dummies)."""
        self.micro_batches
        return self._n_real

    def has(self, name: str) -> bool:
        return self._mbs is not None and all(name in mb.tensors for mb in self._mbs)

    # ------------------------------------------------------------------ columns
    def put_packed(self, name: str, outs: Sequence[torch.Tensor]) -> None:
        """Column `name` from one packed (T,) output per micro-batch (a forward's, in micro_batches'
        order, dummies included); a dummy's row becomes a float32 zero, as pack_equal's dummies had."""
        mbs = self.micro_batches
        if len(outs) != len(mbs):
            raise ValueError(f"{len(outs)} outputs for {len(mbs)} micro-batches")
        for mb, out in zip(mbs, outs):
            if mb.is_dummy:
                mb.tensors[name] = torch.zeros(mb.num_tokens, dtype=torch.float32)
                continue
            out = out[0] if out.ndim == 2 and out.shape[0] == 1 else out
            if out.shape[0] != mb.num_tokens:
                raise ValueError(f"{name}: an output of {out.shape[0]} tokens for a micro-batch of {mb.num_tokens}")
            mb.tensors[name] = out

    def put(self, name: str, per_traj: Sequence[torch.Tensor]) -> None:
        """Column `name` from one (T_i,) tensor per trajectory (in `trajs`' order), scattered into the
        packed rows once (the same concatenation pack_micro_batches makes)."""
        if len(per_traj) != len(self.trajs):
            raise ValueError(f"{name} has {len(per_traj)} entries for {len(self.trajs)} trajectories")
        for mb in self.micro_batches:
            if mb.is_dummy:
                mb.tensors[name] = torch.zeros(mb.num_tokens, dtype=torch.float32)
                continue
            pieces = [torch.as_tensor(per_traj[i]) for i in mb.seq_indices]
            for i, p in zip(mb.seq_indices, pieces):
                if p.ndim != 1 or p.shape[0] != len(self.trajs[i].token_ids):
                    raise ValueError(f"{name}[{i}] has shape {tuple(p.shape)}, expected ({len(self.trajs[i].token_ids)},)")
            mb.tensors[name] = torch.cat(pieces)

    def column(self, name: str) -> list[torch.Tensor]:
        """Column `name` per trajectory (views into the packed rows), in `trajs`' order."""
        mbs = self.micro_batches[:self.num_real]
        return unpack_to_sequences(mbs, [mb.tensors[name] for mb in mbs], len(self.trajs)) if self.trajs else []

    # ------------------------------------------------------------------ selections
    def view(self, indices: Sequence[int], key: Hashable | None = None) -> "StepBatch":
        """The trajectories `indices` (positions in `trajs`) packed as their own StepBatch (collective:
        one all-reduce when packed). With a `key`, packed once and returned again for the same key (the
        caller guarantees the same indices: a key must name the same selection on every rank and every
        call); without one, packed anew. Columns are not carried: put them (see the module docstring)."""
        if key is not None and key in self._views:
            return self._views[key]
        v = StepBatch([self.trajs[i] for i in indices], self.micro_token_budget,
                      all_reduce_max=self._all_reduce_max, _clock=self._clock)
        v.micro_batches   # packed now, so its time and all-reduce fall here on every rank
        if key is not None:
            self._views[key] = v
        return v


def put_missing(batch: StepBatch, columns: dict[str, Sequence[torch.Tensor] | None], sub: Sequence[int]) -> None:
    """Put each column (per trajectory of the step, indexed by `sub` into `batch`'s trajectories)
    that `batch` does not hold yet; None columns are skipped."""
    for name, per_traj in columns.items():
        if per_traj is not None and not batch.has(name):
            batch.put(name, [per_traj[i] for i in sub])
