"""A user's own comm method, tracker, optimizer and strategy, each a class or function in their own package with
a config file in their own ``--config-dir``, train together through ``train.py`` without any file under
``distrain/`` changing; each one's own checks (``check_config``, a tracker's ``check``) and the strategy's
declared capabilities are honoured before any rank starts, in one line."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import pytest
from helpers import FAST, REPO, run_train

PACKAGE = '''
"""The user's own extensions of distrain."""
import json
from pathlib import Path

import torch

from distrain.comm.ddp_comm import DDPComm
from distrain.config.checks import ConfigError
from distrain.parallelism.capabilities import Capabilities
from distrain.parallelism.ddp import DDPStrategy
from distrain.trackers.base import TrackerSetupError


class RoundedComm(DDPComm):
    """Averages each gradient bucket after rounding it to bfloat16 precision."""

    @staticmethod
    def check_config(cfg, placement):
        if cfg.comm.bucket_cap_mb > 16:
            raise ConfigError("comm.bucket_cap_mb", cfg.comm.bucket_cap_mb, "at most 16 with comm=rounded")
        return []

    def average_bucket(self, bucket):
        buffer = bucket.buffer()
        buffer.copy_(buffer.to(torch.bfloat16).to(buffer.dtype))
        return super().average_bucket(bucket)


class FileTracker:
    def __init__(self, *, path):
        self.path = Path(path)

    def check(self):
        if self.path.is_dir():
            raise TrackerSetupError("path", str(self.path), "a file (this is a directory)")

    def start(self, run):
        self.file = self.path.open("a")

    def log(self, record):
        self.file.write(json.dumps({"my_step": record["step"], "my_loss": record.get("loss")}) + "\\n")
        self.file.flush()

    def finish(self, summary):
        self.file.close()


def plain_sgd(named_parameters, lr, **unused):
    return torch.optim.SGD([p for _, p in named_parameters], lr=lr)


def _check_plain_sgd(cfg, placement):
    if cfg.optimizer.lr > 1:
        raise ConfigError("optimizer.lr", cfg.optimizer.lr, "at most 1 for optimizer=plain")
    return ["optimizer=plain: the user's own check ran"]


plain_sgd.check_config = _check_plain_sgd


class SyncDDP(DDPStrategy):
    """DDP that declares it cannot save in the background."""

    capabilities = Capabilities(comm_hooks=True, memory_formula="ddp", async_save=False)
'''

CONFIGS = {
    "comm/rounded.yaml": """
        defaults:
          - /schema/comm/ddp@_here_
          - _self_
        _target_: my_ext.RoundedComm
        name: rounded
        bucket_cap_mb: 8
    """,
    "logger/file.yaml": """
        file:
          _target_: my_ext.FileTracker
          path: ${hydra:runtime.output_dir}/mine.jsonl
    """,
    "optimizer/plain.yaml": """
        _target_: my_ext.plain_sgd
        _partial_: true
        lr: 0.05
    """,
    "parallelism/sync_ddp.yaml": """
        defaults:
          - /schema/parallelism/ddp@_here_
          - _self_
        _target_: my_ext.SyncDDP
        name: sync_ddp
    """,
}
PLUGINS = ["comm=rounded", "logger=file", "optimizer=plain", "parallelism=sync_ddp"]


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.as_posix().encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user")
    (root / "my_ext").mkdir()
    (root / "my_ext" / "__init__.py").write_text(PACKAGE)
    for name, text in CONFIGS.items():
        (root / "my_conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "my_conf" / name).write_text(textwrap.dedent(text))
    return root


def user_run(user_dir: Path, *overrides: str):
    args = ["--config-dir", str(user_dir / "my_conf"), *FAST, *PLUGINS, "trainer.max_steps=3", *overrides]
    return run_train(args, user_dir, env={"PYTHONPATH": str(user_dir)})


def test_the_four_kinds_of_plug_in_train_together_without_touching_distrain(user_dir):
    before = tree_digest(REPO / "distrain")
    done = user_run(user_dir, "hydra.run.dir=run")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((user_dir / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 2
    assert (summary["parallelism"], summary["comm"], summary["optimizer"]) == ("sync_ddp", "rounded", "plain_sgd")
    records = [json.loads(line) for line in (user_dir / "run" / "mine.jsonl").read_text().splitlines()]
    assert [r["my_step"] for r in records] == [1, 2, 3] and all(r["my_loss"] > 0 for r in records)
    assert "optimizer=plain: the user's own check ran" in done.stdout + done.stderr
    assert tree_digest(REPO / "distrain") == before


@pytest.mark.parametrize(
    "override,key",
    [
        ("comm.bucket_cap_mb=32", "comm.bucket_cap_mb"),  # the comm method's own check
        ("optimizer.lr=2", "optimizer.lr"),  # the optimizer's own check
        ("logger.file.path=.", "logger.file.path"),  # the tracker's own check
        ("checkpoint.async_save=true", "checkpoint.async_save"),  # the strategy's declared capability
    ],
)
def test_each_plug_ins_own_checks_refuse_in_one_line_before_any_rank(user_dir, override, key):
    done = user_run(user_dir, override, f"hydra.run.dir=refused_{key}")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert last.startswith(f"distrain: invalid config: {key}="), last
