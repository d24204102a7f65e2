"""data.document_masking=true through train.py: check_model's layouts (data, tensor, pipeline, context parallel and
their compositions) train on packed, masked windows with the one-process losses, which differ from the unmasked
ones; and what cannot be masked is refused in one line before any rank starts."""

import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, run_train, write_token_dataset

from distrain.data.corpus import stdlib_source_files

pytestmark = [pytest.mark.integration]

EOS = 0  # NUL: never a byte of the standard library's source text


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """Byte-valued ids of standard-library source, each non-empty line a document ended by EOS (vocabulary 256):
    short documents, several to a window, so that masking changes the losses early."""
    lines = [line for path in stdlib_source_files()[:40] for line in path.read_bytes().splitlines() if line.strip()]
    ids = np.frombuffer(b"".join(line + bytes([EOS]) for line in lines[:6000]), dtype=np.uint8)
    cut = len(ids) * 9 // 10
    return write_token_dataset(
        tmp_path_factory.mktemp("documents"), {"train": [ids[:cut]], "val": [ids[cut:]]}, eos_id=EOS
    )


def check_model(*args):
    command = [sys.executable, "-m", "distrain.tools.check_model", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)


def rows(stdout):
    """layout -> (loss, max |diff|, result)."""
    return {name: (float(loss), diff, result) for name, _, loss, diff, result in
            (line.split(maxsplit=4) for line in stdout.splitlines()[1:])}  # fmt: skip


LAYOUTS = "ddp,zero2,tensor_sp_lp,pipeline,cp2,hybrid_tp2_pp2"


def test_every_kind_of_layout_trains_masked_windows_like_one_process(documents):
    data = ["model=llama_tiny", "model.n_layers=2", "data=tokens", f"data.path={documents}", "data.seq_len=128"]
    masked = check_model(*data, "data.document_masking=true", "--layouts", LAYOUTS)
    assert masked.returncode == 0, masked.stdout + masked.stderr
    table = rows(masked.stdout)
    assert set(table) == {"single", *LAYOUTS.split(",")}
    for name, (_, diff, result) in table.items():
        assert result == ("reference" if name == "single" else "pass"), (name, result)
        assert name == "single" or float(diff) <= 1e-4, (name, diff)
    plain = check_model(*data, "--layouts", "ddp")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert abs(rows(plain.stdout)["single"][0] - table["single"][0]) > 1e-3  # the masks change what is learned


def test_gpt_with_learned_positions_trains_masked_windows_under_fsdp_and_a_pipeline(documents):
    data = ["model.n_layers=2", "data=tokens", f"data.path={documents}", "data.seq_len=64"]
    done = check_model(*data, "data.document_masking=true", "--layouts", "fsdp,pipeline")
    assert done.returncode == 0, done.stdout + done.stderr
    assert {name: result for name, (_, _, result) in rows(done.stdout).items()} == {
        "single": "reference",
        "fsdp": "pass",
        "pipeline": "pass",
    }


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ([], "data.document_masking=true is not allowed: false for this data: its text is one stream without"),
        (["model=mlp", "data=tokens"], "false for the mlp model: its forward takes no documents"),
        (["data=tokens", "no_eos"], "false for the dataset of data.path: its index names no end-of-document id"),
        (["data=tokens", "ft=torchft"], "false with ft=torchft: replica groups average their gradients with equal"),
    ],
    ids=["stdlib-corpus", "model-without-documents", "dataset-without-ends", "replica-groups"],
)
def test_what_cannot_be_masked_is_refused_in_one_line(documents, tmp_path, extra, words):
    args = ["data.document_masking=true", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"]
    if "data=tokens" in extra:
        path = documents
        if "no_eos" in extra:
            ids = np.arange(4000, dtype=np.uint8)
            path = write_token_dataset(tmp_path / "plain", {"train": [ids], "val": [ids[:1000]]})
        args.append(f"data.path={path}")
    done = run_train([*args, *(e for e in extra if e != "no_eos")], cwd=REPO)
    assert done.returncode != 0
    assert words in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
