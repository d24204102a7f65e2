"""``python -m distrain.tools.check_model``: llama_tiny is exact under every layout; the own-model example
(docs/models.md)
works as written; a layout that is not exact is reported as failing; bad arguments get one line."""

import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, documentation


def check_model(*args: str, env: dict[str, str] | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distrain.tools.check_model", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def rows(stdout: str) -> dict[str, list[str]]:
    """layout -> its row's columns (ranks, loss, max |diff|, result and note)."""
    table = {}
    for line in stdout.splitlines()[1:]:
        name, ranks, loss, diff, result = line.split(maxsplit=4)
        table[name] = [ranks, loss, diff, result]
    return table


# One layout of each kind; the rest (zero 1/2/3, tensor without options, hsdp_2x2, hybrid_dp2_tp2, cp2, ep2) run in
# their own tests, which keeps this test's time down.
CHECKED = "ddp,fsdp,tensor_sp_lp,pipeline,hybrid_tp2_pp2"


def test_llama_tiny_is_exact_under_a_layout_of_each_kind():
    done = check_model("model=llama_tiny", "--layouts", CHECKED)
    assert done.returncode == 0, done.stdout + done.stderr
    table = rows(done.stdout)
    assert set(table) == {"single", *CHECKED.split(",")}
    for name, (_, loss, diff, result) in table.items():
        assert result == ("reference" if name == "single" else "pass"), (name, result)
        assert float(diff) <= 1e-3 and abs(float(loss) - float(table["single"][1])) <= 1e-3, (name, loss, diff)


def test_the_check_covers_the_configured_optimizer():
    """Muon, a distributed optimizer, is checked like the model: its sharded Newton-Schulz against one process."""
    done = check_model("model=llama_tiny", "optimizer=muon", "--layouts", "fsdp,zero1")
    assert done.returncode == 0, done.stdout + done.stderr
    table = rows(done.stdout)
    assert table["fsdp"][3] == "pass" and float(table["fsdp"][2]) <= 1e-3
    # DeepSpeed's Muon (zero) runs without clipping, which the one-process reference applies: not compared.
    assert table["zero1"][3].startswith("unsupported: trainer.grad_clip_norm=1.0 is not applied with optimizer=muon")


def readme_block(first_line: str) -> str:
    """The code block of the README or docs/ that starts with ``first_line`` (a file's name in a comment)."""
    for block in re.findall(r"```(?:python|yaml)\n(.*?)```", documentation(), flags=re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"README and docs/ have no code block starting {first_line!r}")


@pytest.fixture()
def readme_model(tmp_path):
    """The README's example model file in a directory on PYTHONPATH and its config in conf/model/."""
    (tmp_path / "my_model.py").write_text(readme_block("# my_model.py"))
    config = REPO / "conf" / "model" / "my_mlp.yaml"
    config.write_text(readme_block("# conf/model/my_mlp.yaml"))
    try:
        yield {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    finally:
        config.unlink()


def test_the_readme_example_model_trains_and_checks_as_the_readme_says(readme_model):
    done = check_model("model=my_mlp", "--layouts", "fsdp,tensor,tensor_sp_lp,pipeline", env=readme_model)
    assert done.returncode == 0, done.stdout + done.stderr
    table = rows(done.stdout)
    assert [table[name][3] for name in ("fsdp", "tensor", "pipeline")] == ["pass"] * 3
    assert table["tensor_sp_lp"][3].startswith("unsupported: parallelism.sequence_parallel=true")
    assert "has no sequence_parallel form" in table["tensor_sp_lp"][3]


def test_a_layout_that_is_not_exact_fails_the_check():
    # Dropout draws different masks on a tensor-parallel rank's heads than on the whole model's.
    done = check_model("model=gpt_tiny", "model.dropout=0.3", "--layouts", "tensor", "--steps", "3")
    assert done.returncode == 1, done.stdout + done.stderr
    assert rows(done.stdout)["tensor"][3] == "fail"
    assert "tensor did not match one process" in done.stderr


def test_unsupported_layouts_are_named_with_the_reason_and_bad_arguments_get_one_line():
    done = check_model("model=mlp", "--layouts", "tensor", "--steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "unsupported: model='MLPLanguageModel' is not allowed" in rows(done.stdout)["tensor"][3]
    bad = check_model("--layouts", "tensr")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--layouts tensr is not allowed" in bad.stderr
    refused = check_model("model=llama_tiny", "model.n_kv_heads=3", "--layouts", "ddp")
    assert refused.returncode == 2 and refused.stderr == (
        "distrain: invalid config: model.n_kv_heads=3 is not allowed: a divisor of model.n_heads (4)\n"
    )
    owned = check_model("model=llama_tiny", "precision=bf16")
    assert owned.returncode == 2 and "precision=bf16 is not allowed: the check sets" in owned.stderr
    typo = check_model("model.d_modl=3")
    assert typo.returncode == 2 and "model.d_modl" in typo.stderr and typo.stderr.count("\n") == 1
