"""``comm=diloco``: DiLoCo (arXiv 2311.08105) and its streaming form (2501.18512) over the job's data-parallel ranks.

Each rank is a worker: its inner optimizer (the ``optimizer`` group's) steps on the rank's own gradient, and no
gradient travels. Every ``sync_every`` steps the workers average their *pseudo-gradient*, the outer parameters
minus the rank's parameters, and an outer optimizer (SGD with Nesterov momentum, lr 0.7 and momentum 0.9 as the
paper) steps the outer parameters with it; every rank then continues from them. With ``fragments=F`` the
parameters split into F contiguous fragments, synchronised in turn (fragment f after inner step (f+1)*H/F of each
cycle), so the bytes of one sync are spread over the cycle (Streaming DiLoCo's lower peak bandwidth).

The pseudo-gradient can itself be compressed (``compression``): ``topk`` sends the ``density`` share of entries
with the largest magnitude as (value, index) pairs, with error feedback (what is not sent is added to the next
sync's pseudo-gradient); ``powersgd`` sends each weight matrix as rank-``rank`` factors (one power iteration, warm
started, with error feedback), vectors whole.

Where tensors live: the outer parameters, their momentum and the residuals are flat fp32 tensors on the
parameters' device, one per fragment. Collectives: only at a fragment's sync, one all-reduce of its pseudo-gradient
(dense), an all-gather of (value, index) pairs (topk) or two all-reduces of factors plus one of the vectors
(powersgd). Steps the loop evaluates or checkpoints after, and the last, synchronise every fragment, so
evaluations, checkpoints and the final model are the outer model, the same on every rank.

Under ``ft=torchft`` the workers are the replica groups: inside a group DDP all-reduces every step's gradients
over the group's ranks; an outer step starts with a torchft quorum (``quorum_due``), averages the pseudo-gradient
(or PowerSGD's factors) through the Manager's all-reduce over the groups, then one more all-reduce carries the stop
flag and ``should_commit`` decides whether the outer step is applied.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distrain.comm.checks import check_averaging
from distrain.comm.ddp_comm import DDPComm
from distrain.comm.topk import copy_from_flat, flatten
from distrain.comm.traffic import all_gather_bytes, all_reduce_bytes
from distrain.config.checks import ConfigError, at_least, check, positive
from distrain.errors import RunError
from distrain.ft.config import has_replica_groups
from distrain.launch.process_group import DistEnv
from distrain.parallelism.checks import meta_model

log = logging.getLogger("distrain.train")

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from distrain.config.options import Placement


class DiLoCoComm(DDPComm):
    """DiLoCo's inner and outer steps (module docstring). The strategy treats it as an option whose ranks step on
    their own gradients (``local_steps``): each rank keeps its inner optimizer's state (in checkpoints too) and
    clips its own gradient with the whole threshold (``shared_clip_norm`` False: no collective per inner step)."""

    local_steps = True
    shared_clip_norm = False
    # Under ft=torchft the replica groups are the workers: inside a group DDP averages every step's gradients, and
    # the outer steps average the groups' pseudo-gradients through torchft's Manager, with a quorum only there.
    syncs_replica_groups = True

    def __init__(
        self,
        *,
        sync_every: int,
        outer_lr: float,
        outer_momentum: float,
        nesterov: bool,
        fragments: int,
        compression: str,
        density: float,
        rank: int,
        **ddp: Any,
    ) -> None:
        super().__init__(**ddp)
        self.sync_every, self.fragments, self.compression = sync_every, fragments, compression
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.density, self.rank_of_factors = density, rank

    @classmethod
    def check_config(cls, cfg: DictConfig, placement: Placement) -> list[str]:
        check_averaging(cfg, as_hook=True)
        comm = cfg.comm
        check(cfg, "comm.sync_every", at_least(1), "an integer >= 1 (inner steps between outer steps)")
        check(cfg, "comm.fragments", at_least(1), "an integer >= 1")
        if comm.sync_every % comm.fragments:
            raise ConfigError(
                "comm.fragments", comm.fragments, f"a divisor of comm.sync_every ({comm.sync_every}): one fragment "
                "syncs every sync_every/fragments steps"
            )  # fmt: skip
        check(cfg, "comm.outer_lr", positive, "a learning rate > 0 (the DiLoCo paper's 0.7)")
        check(cfg, "comm.outer_momentum", lambda v: 0 <= v < 1, "a number in [0, 1)")
        if comm.nesterov and comm.outer_momentum == 0:
            raise ConfigError("comm.nesterov", True, "false when comm.outer_momentum is 0 (Nesterov needs momentum)")

        check(cfg, "comm.density", lambda v: v is not None and 0 < v <= 1, "a fraction in (0, 1]")
        check(cfg, "comm.rank", at_least(1), "an integer >= 1 (rank of the pseudo-gradient's factors)")
        if has_replica_groups(cfg) and cfg.ft.replica_groups > 2 and placement.world_size > 1:
            raise ConfigError(
                "ft.replica_groups", cfg.ft.replica_groups, "2 with comm=diloco and groups of several ranks (a "
                "healing group's ranks may copy different live groups, whose inner states differ), or one rank per "
                "group (as many groups as ranks)"
            )  # fmt: skip
        if comm.compression == "topk" and has_replica_groups(cfg):
            raise ConfigError(
                "comm.compression", "topk", "none or powersgd with ft=torchft (the groups average through torchft's "
                "all-reduce; top-k gathers (value, index) pairs)"
            )  # fmt: skip
        built = meta_model(cfg, strict=False)
        tensors = sum(1 for p in built[0].parameters() if p.requires_grad) if built else None
        if tensors is not None and comm.fragments > tensors:
            raise ConfigError("comm.fragments", comm.fragments, f"at most the model's {tensors} trainable tensors")
        return _extra_sync_notes(cfg)

    def prepare(self, model: DistributedDataParallel, env: DistEnv) -> None:
        params = [p for p in model.module.parameters() if p.requires_grad]
        self.groups = _split(params, self.fragments)
        self.outer = [flatten(group).float() for group in self.groups]
        self.momentum = [torch.zeros_like(outer) for outer in self.outer]
        self.residual = [torch.zeros_like(outer) for outer in self.outer] if self.compression != "none" else []
        self.dense_numel = sum(p.numel() for p in params)
        self._factors: dict[tuple[int, int], torch.Tensor] = {}  # powersgd's warm-started Q per (fragment, matrix)
        self._new_factors: dict[tuple[int, int], torch.Tensor] = {}  # this sync's, kept once it counts
        if self.compression == "powersgd":
            self._start_factors()

    def average_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """No collective: the bucket keeps this rank's gradient, for this rank's inner optimizer. Under replica
        groups the group is the worker: DDP's all-reduce over the group's ranks."""
        if self.replica_groups is not None:
            return super().average_bucket(bucket)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    def checking(self) -> bool:
        return False

    @torch.no_grad()
    def finish_update(self, *, stepped: bool = True) -> dict[str, Any]:
        """After the inner step: the outer step of each fragment due now (every fragment on a step the loop
        evaluates or checkpoints after, or the last). The report's ``update_dropped`` is True when a pseudo-gradient
        mean was not finite: that fragment returns to its outer parameters, unchanged. Under replica groups a sync
        the quorum does not commit (a group failed during it) changes nothing: the fragments go on from their local
        parameters and sync at their next turn."""
        del stepped  # a skipped inner step changes nothing here: the fragment syncs what the rank holds
        due = [index for index in range(self.fragments) if self._syncs(index)]
        dropped = False
        if due:
            launched = self.clock.mark()
            means = [
                (index, *self._average(index, self.outer[index] - flatten(self.groups[index]).float())) for index in due
            ]
            if self._committed():
                for index, mean, residual in means:
                    dropped |= not self._apply_outer_step(index, mean, residual)
                for key, factor in self._new_factors.items():  # PowerSGD's warm start moves only with the sync
                    self._factors[key].copy_(factor)
            self._new_factors.clear()
            self.intervals.append((launched, self.clock.mark()))
        # What a dense all-reduce of every step would send: across the workers (plus, under replica groups, the
        # group's own all-reduce, which its DDP hook counted).
        across = all_reduce_bytes(self.dense_numel * 4, self._workers())
        self.dense_bytes = self.dense_bytes + across if self.replica_groups is not None else across
        return {
            "comm_bytes": self.bytes_sent,
            "comm_dense_bytes": self.dense_bytes,
            "comm_intervals": self.intervals,
            "comm_after_backward": self.intervals,
            "update_dropped": dropped,
        }

    def quorum_due(self, step: int) -> bool:
        """Whether step ``step`` syncs some fragment: the steps with a replica-group quorum."""
        return self.is_exact_step(step) or any(self._due(index, step) for index in range(self.fragments))

    def _syncs(self, index: int) -> bool:
        return self.is_exact_step(self.step) or self._due(index, self.step)

    def _due(self, index: int, step: int) -> bool:
        """Fragment ``index`` syncs after inner step (index+1)*H/F of each cycle of H steps."""
        return (step - (index + 1) * self.sync_every // self.fragments) % self.sync_every == 0

    def _workers(self) -> int:
        """Who averages a pseudo-gradient: the ranks, or under replica groups the groups in the quorum."""
        return self.replica_groups.participants() if self.replica_groups is not None else self.world_size

    def _committed(self) -> bool:
        """Without replica groups every sync counts; with them, the quorum decides (and carries a stop signal)."""
        if self.replica_groups is None or self.replica_groups.commit():
            return True
        log.warning(
            "comm=diloco: the outer step after step %d was not committed by the replica groups' quorum (%s); the "
            "fragments sync at their next turn",
            self.step,
            self.replica_groups.last_failure or "a group failed",
        )
        return False

    def _apply_outer_step(self, index: int, mean: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """The outer Nesterov step of one fragment with its mean pseudo-gradient; returns whether it was applied (a
        mean that is not finite, the same on every rank, leaves the outer state and residual as they were and puts
        the fragment back at its outer parameters)."""
        params, outer, momentum = self.groups[index], self.outer[index], self.momentum[index]
        if not bool(torch.isfinite(mean).all()):
            copy_from_flat(params, outer)
            return False
        if residual is not None:
            self.residual[index].copy_(residual)
        momentum.mul_(self.outer_momentum).add_(mean)
        outer.sub_(self.outer_lr * (mean + self.outer_momentum * momentum if self.nesterov else momentum))
        copy_from_flat(params, outer)
        return True

    def _average(self, index: int, pseudo_gradient: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ranks' mean pseudo-gradient as this option's compression sends it, and with compression the new
        residual (what this rank did not send, kept for the next sync)."""
        if self.compression == "none":
            return self._all_reduce_mean(pseudo_gradient), None
        candidate = pseudo_gradient + self.residual[index]
        mine, mean = self._topk(candidate) if self.compression == "topk" else self._powersgd(index, candidate)
        return mean, candidate - mine

    def _topk(self, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what this rank sent, the ranks' mean): an all-gather of its top-k (value, int32 index) pairs."""
        k = min(candidate.numel(), max(1, math.ceil(self.density * candidate.numel())))
        indices = candidate.abs().topk(k).indices
        values = candidate[indices]
        gathered_values = [torch.empty_like(values) for _ in range(self.world_size)]
        gathered_indices = [torch.empty_like(indices, dtype=torch.int32) for _ in range(self.world_size)]
        dist.all_gather(gathered_values, values)
        dist.all_gather(gathered_indices, indices.to(torch.int32))
        self.bytes_sent += all_gather_bytes(k * 8, self.world_size)
        mean = torch.zeros_like(candidate)
        for rank_values, rank_indices in zip(gathered_values, gathered_indices, strict=True):  # in rank order
            mean.index_add_(0, rank_indices.long(), rank_values)
        mine = torch.zeros_like(candidate)
        mine[indices] = values
        return mine, mean / self.world_size

    def _powersgd(self, index: int, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what this rank's factors stand for, the ranks' mean): each weight matrix M as P Q^T with P = mean(M Q)
        orthonormalised and Q = mean(M^T P) (two all-reduces for all matrices), vectors all-reduced whole."""
        matrices, vectors, offset = [], [], 0
        for param in self.groups[index]:
            piece = candidate[offset : offset + param.numel()]
            (matrices if param.dim() >= 2 else vectors).append((offset, piece.view(param.shape[0], -1)))
            offset += param.numel()
        mine, mean = torch.zeros_like(candidate), torch.zeros_like(candidate)
        if vectors:
            flat = torch.cat([piece.reshape(-1) for _, piece in vectors])
            summed = self._all_reduce_mean(flat)
            self._scatter(mine, vectors, flat)
            self._scatter(mean, vectors, summed)
        if matrices:
            qs = [self._factors[(index, i)] for i in range(len(matrices))]
            ps = self._all_reduce_mean(torch.cat([(m @ q).reshape(-1) for (_, m), q in zip(matrices, qs, strict=True)]))
            ps = [
                torch.linalg.qr(p)[0]
                for p in _split_as(ps, [(m.shape[0], q.shape[1]) for (_, m), q in zip(matrices, qs, strict=True)])
            ]
            new_qs = self._all_reduce_mean(
                torch.cat([(m.T @ p).reshape(-1) for (_, m), p in zip(matrices, ps, strict=True)])
            )
            new_qs = _split_as(new_qs, [q.shape for q in qs])
            for i, ((at, m), p, q) in enumerate(zip(matrices, ps, new_qs, strict=True)):
                self._new_factors[(index, i)] = q
                mean[at : at + m.numel()] = (p @ q.T).reshape(-1)
                mine[at : at + m.numel()] = (p @ (m.T @ p).T).reshape(-1)
        return mine, mean

    def _start_factors(self) -> None:
        """Each weight matrix's Q: the same random orthonormal start on every rank (live tensors, checkpointed)."""
        for index, group in enumerate(self.groups):
            matrices = [p for p in group if p.dim() >= 2]
            for position, param in enumerate(matrices):
                columns = param.numel() // param.shape[0]
                rank = min(self.rank_of_factors, param.shape[0], columns)
                generator = torch.Generator().manual_seed(1000 * index + position)
                start = torch.randn(columns, rank, generator=generator)
                self._factors[(index, position)] = torch.linalg.qr(start)[0].to(param.device)

    def _all_reduce_mean(self, flat: torch.Tensor) -> torch.Tensor:
        if self.replica_groups is not None:  # the groups' mean through torchft's Manager (in place)
            self.bytes_sent += all_reduce_bytes(flat.numel() * 4, self._workers())
            return self.replica_groups.average_flat(flat.contiguous())
        flat = flat / self.world_size
        self.bytes_sent += all_reduce_bytes(flat.numel() * 4, self.world_size)
        dist.all_reduce(flat)
        return flat

    @staticmethod
    def _scatter(target: torch.Tensor, pieces: list[tuple[int, torch.Tensor]], flat: torch.Tensor) -> None:
        offset = 0
        for at, piece in pieces:
            target[at : at + piece.numel()] = flat[offset : offset + piece.numel()]
            offset += piece.numel()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Live tensors a checkpoint keeps for an exact resume: the outer parameters and momentum, the residuals and
        PowerSGD's factors (with compression) and this rank's own parameters (between syncs each rank's differ from
        the model the checkpoint holds once); a load fills them in place and ``on_resume`` puts them back. The keys
        name the number of fragments: a checkpoint of another split is not read as this one's."""
        self._local = [flatten(group).float() for group in self.groups]
        prefix = f"fragments{len(self.groups)}_"
        state: dict[str, torch.Tensor] = {}
        for i in range(len(self.groups)):
            state |= {f"{prefix}outer{i}": self.outer[i], f"{prefix}momentum{i}": self.momentum[i]}
            state[f"{prefix}local{i}"] = self._local[i]
            if self.residual:
                state[f"{prefix}residual{i}"] = self.residual[i]
        return state | {f"{prefix}factor{i}_{j}": q for (i, j), q in self._factors.items()}

    def on_resume(self, step: int, restored: bool) -> None:
        """Restored: this rank's parameters back from its own state. Not (another world size, another comm option
        or split saved it): the loaded model becomes the outer model, with no momentum, residual or warm start."""
        super().on_resume(step, restored)
        if restored:
            with torch.no_grad():
                for group, local in zip(self.groups, self._local, strict=True):
                    copy_from_flat(group, local)
            return
        self.outer = [flatten(group).float() for group in self.groups]
        for state in (*self.momentum, *self.residual):
            state.zero_()
        if self._factors:
            self._start_factors()


def _extra_sync_notes(cfg: DictConfig) -> list[str]:
    """Evaluations and periodic checkpoints sync every fragment (an extra outer step with momentum) at steps that
    are not multiples of comm.sync_every: say so, since training then depends on when they happen."""
    period = cfg.comm.sync_every // cfg.comm.fragments
    notes = []
    for key, every in (
        ("trainer.eval_every", cfg.trainer.eval_every),
        ("checkpoint.every_n_steps", cfg.checkpoint.every_n_steps),
    ):
        if every and every % period:
            notes.append(
                f"comm=diloco: {key}={every} is not a multiple of comm.sync_every/comm.fragments ({period}); each "
                "evaluation or checkpoint there adds an outer step of every fragment, so training depends on it"
            )
    return notes


def _split(params: list[torch.nn.Parameter], fragments: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters in ``fragments`` non-empty groups of about equal size in elements; where one tensor
    spans several groups' share (a large embedding), of about equal numbers of tensors instead."""
    if len(params) < fragments:
        raise RunError(
            f"comm.fragments={fragments} is not allowed: at most the model's {len(params)} trainable tensors"
        )
    total = sum(p.numel() for p in params)
    groups: list[list[torch.nn.Parameter]] = [[] for _ in range(fragments)]
    seen = 0
    for param in params:
        groups[min(fragments - 1, seen * fragments // total)].append(param)
        seen += param.numel()
    if all(groups):
        return groups
    per_group, extra = divmod(len(params), fragments)
    starts = [i * per_group + min(i, extra) for i in range(fragments + 1)]
    return [params[starts[i] : starts[i + 1]] for i in range(fragments)]


def _split_as(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    pieces, offset = [], 0
    for rows, cols in shapes:
        pieces.append(flat[offset : offset + rows * cols].view(rows, cols))
        offset += rows * cols
    return pieces
