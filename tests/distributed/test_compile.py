"""compile=true (torch.compile with inductor, generated C++ kernels on CPU) on 2 gloo ranks: the losses of the same
run in eager mode, for every strategy that supports it, per block and whole-model."""

from helpers import FAST, compose_config, on_ranks, to_plain, train_steps

STEPS = 5
# Inductor fuses and reorders floating-point operations, so losses agree to rounding, not bit for bit: measured
# max |difference| 1e-6 on these runs (losses around 5); the tolerance leaves a decade of room.
TOLERANCE = 1e-5
CASES = {  # name: (overrides, the eager run to compare with)
    "ddp": (["parallelism=ddp"], "ddp"),
    "ddp, whole model": (["parallelism=ddp", "compile_scope=model"], "ddp"),
    "fsdp": (["parallelism=fsdp", "stage=3"], "fsdp"),
    "tensor": (["parallelism=tensor"], "tensor"),
}
EAGER = {name: overrides for name, (overrides, _) in CASES.items() if name in ("ddp", "fsdp", "tensor")}


def test_compiled_losses_match_eager_losses():
    configs = {f"eager {name}": [*overrides, "compile=false"] for name, overrides in EAGER.items()}
    configs |= {name: [*overrides, "compile=true"] for name, (overrides, _) in CASES.items()}
    cfgs = [to_plain(compose_config([*FAST, *overrides])) for overrides in configs.values()]
    results = dict(zip(configs, on_ranks(train_steps, 2, cfgs, STEPS)[0], strict=True))
    for name, (_, eager_name) in CASES.items():
        eager, compiled = results[f"eager {eager_name}"], results[name]
        assert compiled["compile"]["graphs"] >= 1, (name, compiled["compile"])
        assert compiled["compile"]["graph_breaks"] == 0, (name, compiled["compile"])
        worst = max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"], strict=True))
        assert worst < TOLERANCE, f"{name}: max |compiled - eager loss| = {worst}"
        assert compiled["losses"][-1] < compiled["losses"][0], name
