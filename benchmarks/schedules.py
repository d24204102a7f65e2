"""The learning-rate curve of every schedule (``scheduler.decay``), as distrain computes it, in one plot.

No training: the factors come from ``distrain.optim.schedule.warmup_decay_factor``, the function the runs use.
Also shows what makes WSD extendable: a 1000-step WSD plan and the same run continued to 1500 steps share the curve
up to the shorter plan's decay.

    python benchmarks/schedules.py --out-dir benchmarks/results      # schedules.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from distrain.optim.schedule import warmup_decay_factor

CURVES = {  # label: (decay, decay_shape, total steps)
    "cosine": ("cosine", "linear", 1000),
    "linear": ("linear", "linear", 1000),
    "constant": ("constant", "linear", 1000),
    "wsd, linear decay": ("wsd", "linear", 1000),
    "wsd, cosine decay": ("wsd", "cosine", 1000),
    "wsd, 1-sqrt decay": ("wsd", "1-sqrt", 1000),
    "wsd extended to 1500 steps": ("wsd", "1-sqrt", 1500),
}
SETTINGS = {"warmup_steps": 50, "min_lr_ratio": 0.1, "decay_fraction": 0.2}


def curve(decay: str, shape: str, total: int) -> list[float]:
    return [
        warmup_decay_factor(step, total_steps=total, decay=decay, decay_shape=shape, **SETTINGS)
        for step in range(total)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4))
    for label, (decay, shape, total) in CURVES.items():
        style = ":" if "extended" in label else "-"
        axes.plot(range(total), curve(decay, shape, total), style, label=label, linewidth=1.4)
    axes.set(
        xlabel="optimizer step",
        ylabel="learning rate / optimizer.lr",
        title="scheduler.decay (warmup_steps=50, min_lr_ratio=0.1, decay_fraction=0.2)",
    )
    axes.legend(fontsize="small")
    figure.tight_layout()
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        figure.savefig(args.out_dir / "schedules.png", dpi=100)
        print(f"wrote {args.out_dir / 'schedules.png'}")
    else:
        plt.show()


if __name__ == "__main__":
    main()
