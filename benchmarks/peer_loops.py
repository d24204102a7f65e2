"""The training loops ``benchmarks/peers.py`` runs, one per framework, each as a user of it would write it: the same
model, data, optimizer, schedule, micro-batch, clipping and threads. Each rank 0 writes a JSON result:
``startup_s`` (from ``PEERS_STARTED_AT``, when the command started, to the first step), ``step_time_s`` (mean after
the warm-up steps) and ``final_loss`` (the last steps' mean loss, averaged over ranks)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peers import LAST, MICRO_BATCH, MODEL, SEQ_LEN, WARMUP_STEPS

from distrain.data.corpus import stdlib_source_corpus
from distrain.models.gpt import GPT
from distrain.optim.schedule import warmup_decay_schedule


def corpus_tokens() -> torch.Tensor:
    return stdlib_source_corpus(max_bytes=4_000_000, val_fraction=0.05).train


def random_batch(tokens: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.randint(0, len(tokens) - SEQ_LEN - 1, (MICRO_BATCH,), generator=generator)
    batch = torch.stack([tokens[o : o + SEQ_LEN + 1] for o in offsets.tolist()]).long()
    return batch[:, :-1], batch[:, 1:]


def loss_of(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


def optimizer_and_schedule(model: torch.nn.Module, steps: int) -> tuple[torch.optim.Optimizer, object]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = warmup_decay_schedule(optimizer, total_steps=steps, warmup_steps=20, decay="cosine", min_lr_ratio=0.1)
    return optimizer, schedule


class StepTimer:
    """Wall-clock marks at the start of each step on this rank; the result once training ends."""

    def __init__(self) -> None:
        self.marks: list[float] = []
        self.losses: list[float] = []

    def step(self, loss: float | None = None) -> None:
        self.marks.append(time.time())
        if loss is not None:
            self.losses.append(loss)

    def write(self, path: Path, world: int) -> None:
        """Collective: one all-reduce of the last steps' mean loss. Rank 0 writes the JSON."""
        final = torch.tensor(sum(self.losses[-LAST:]) / LAST)
        dist.all_reduce(final)
        if dist.get_rank() == 0:
            gaps = [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)][WARMUP_STEPS:]
            result = {
                "startup_s": self.marks[0] - float(os.environ["PEERS_STARTED_AT"]),
                "step_time_s": sum(gaps) / len(gaps),
                "final_loss": final.item() / world,
            }
            path.write_text(json.dumps(result))


def threads_per_rank(world: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def train_by_hand(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: object,
    tokens: torch.Tensor,
    rank: int,
    steps: int,
    *,
    backward: Callable[[torch.Tensor], None],
    clip: Callable[..., object] = torch.nn.utils.clip_grad_norm_,
) -> StepTimer:
    """The loop the minimal and Accelerate runs share: a random window per sample (seeded by ``rank``), forward,
    ``backward``, ``clip`` to norm 1, step; only backward and clipping are the framework's."""
    generator, timer = torch.Generator().manual_seed(rank), StepTimer()
    for _ in range(steps):
        timer.step()
        loss = loss_of(model, *random_batch(tokens, generator))
        backward(loss)
        clip(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        timer.losses.append(loss.item())
    timer.step()
    return timer


def minimal_rank(rank: int, world: int, steps: int, port: int, result: Path) -> None:
    """One rank of the hand-written loop: DDP, a random window per sample, forward, backward, clip, step."""
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    threads_per_rank(world)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    tokens = corpus_tokens()
    model = torch.nn.parallel.DistributedDataParallel(GPT(**MODEL))
    optimizer, schedule = optimizer_and_schedule(model, steps)
    train_by_hand(model, optimizer, schedule, tokens, rank, steps, backward=torch.Tensor.backward).write(result, world)
    dist.destroy_process_group()


def minimal(world: int, steps: int, result: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(minimal_rank, args=(world, steps, port, result), nprocs=world)


def lightning(world: int, steps: int, result: Path) -> None:
    """A LightningModule and a Trainer with ``strategy="ddp"`` on CPU (Lightning starts the other ranks by
    re-running this command)."""
    import lightning as L

    threads_per_rank(world)
    tokens = corpus_tokens()

    class Windows(torch.utils.data.IterableDataset):
        def __iter__(self):  # noqa: ANN204 - a random window per sample, seeded per rank
            generator = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
            while True:
                inputs, targets = random_batch(tokens, generator)
                yield from zip(inputs, targets, strict=True)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model, self.timer = GPT(**MODEL), StepTimer()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
            self.timer.step()
            loss = loss_of(self.model, *batch)
            self.timer.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> dict:
            optimizer, schedule = optimizer_and_schedule(self.model, steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

        def on_train_end(self) -> None:
            self.timer.step()
            self.timer.write(result, world)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(Windows(), batch_size=MICRO_BATCH)
    trainer.fit(Module(), loader)
    # Lightning leaves its gloo group up; torn down at interpreter exit, its threads can abort the process
    # ("terminate called without an active exception", seen once in CI after a finished run).
    if dist.is_initialized():
        dist.destroy_process_group()


def accelerate(world: int, steps: int, result: Path) -> None:
    """``Accelerator(cpu=True)`` under torchrun: prepare model, optimizer and schedule, ``accelerator.backward``."""
    from accelerate import Accelerator

    threads_per_rank(world)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    tokens = corpus_tokens()
    model = GPT(**MODEL)
    optimizer, schedule = optimizer_and_schedule(model, steps)
    # The schedule stays outside prepare(): Accelerate would step it once per process per step.
    model, optimizer = accelerator.prepare(model, optimizer)
    train_by_hand(
        model,
        optimizer,
        schedule,
        tokens,
        accelerator.process_index,
        steps,
        backward=accelerator.backward,
        clip=accelerator.clip_grad_norm_,
    ).write(result, world)
    accelerator.end_training()  # tears its process group down before exit, as Lightning's above


WORKERS = {"minimal": minimal, "lightning": lightning, "accelerate": accelerate}
