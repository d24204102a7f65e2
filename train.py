"""distrain's one entry point: compose the config, validate it, start the ranks, train.

python train.py                                   # default: GPT on stdlib source, DDP over 2 CPU ranks
python train.py parallelism=single optimizer=sgd  # any group option, any key, as a Hydra override
torchrun --nproc_per_node 4 train.py ...          # under an outer launcher: one rank per process

Hydra composes ``conf/config.yaml`` with the overrides; everything after that lives in the package:
``distrain.launch.entry.run`` validates and launches, ``distrain.trainer.rank.build_and_train`` is each rank's work,
``distrain.trainer.build.build`` builds its components and ``distrain.trainer.loop.train`` trains.
"""

from __future__ import annotations

import gc
import sys

import hydra
from omegaconf import DictConfig

from distrain.launch.entry import compose_and_run, prepare_command_line, run

# torch's hundreds of thousands of module-level objects never become garbage, yet every full collection walks them
# (80 ms each, several during Hydra's composition and the rest of start-up): set them aside until the shutdown.
gc.freeze()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Train with the composed config; returns the final validation loss (what sweepers optimise)."""
    return run(cfg)


if __name__ == "__main__":
    prepare_command_line(sys.argv)
    try:
        compose_and_run(main, sys.argv)
    finally:
        gc.freeze()  # skip the seconds-long collection of torch's objects at interpreter exit
