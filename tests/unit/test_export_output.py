"""``export`` never replaces what it did not write: an existing output needs --overwrite, and even then only an
earlier export's file or directory is replaced (never a run directory), in one line before anything is read."""

import pytest
import torch

from distrain.checkpoint.export import EXPORT_MARK, main, output_problem


def test_new_outputs_and_empty_directories_are_written(tmp_path):
    assert output_problem(tmp_path / "new", hf=True, overwrite=False) is None
    assert output_problem(tmp_path / "new.pt", hf=False, overwrite=False) is None
    (tmp_path / "empty").mkdir()
    assert output_problem(tmp_path / "empty", hf=True, overwrite=False) is None


def test_an_earlier_export_is_replaced_only_with_overwrite(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "pass --overwrite" in output_problem(tmp_path, hf=True, overwrite=False)
    # The same files, but the user's own Hugging Face directory: export left no mark there.
    assert f"has no {EXPORT_MARK}): not replaced" in output_problem(tmp_path, hf=True, overwrite=True)
    (tmp_path / EXPORT_MARK).write_text("{}")
    assert output_problem(tmp_path, hf=True, overwrite=True) is None
    (tmp_path / "README.md").write_text("my notes")  # added to an earlier export by hand: kept
    assert "README.md was not written by export: not replaced" in output_problem(tmp_path, hf=True, overwrite=True)
    (tmp_path / "model.pt").write_text("my own file")
    assert "pass --overwrite" in output_problem(tmp_path / "model.pt", hf=False, overwrite=False)
    assert "is not a file torch.save wrote" in output_problem(tmp_path / "model.pt", hf=False, overwrite=True)
    torch.save({"weight": torch.zeros(2)}, tmp_path / "model.pt")
    assert output_problem(tmp_path / "model.pt", hf=False, overwrite=True) is None


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_run_directory_is_never_replaced(tmp_path, capsys, overwrite):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    argv = [str(run / "checkpoints" / "step_00000004"), str(run), "--format", "hf"]
    assert main(argv + (["--overwrite"] if overwrite else [])) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(run) in error
    assert (run / "metrics.jsonl").is_file() and (run / "checkpoints" / "step_00000004").is_dir()


def test_a_file_is_not_an_hf_directory_nor_a_directory_a_torch_file(tmp_path):
    (tmp_path / "file").write_text("x")
    assert "is a file" in output_problem(tmp_path / "file", hf=True, overwrite=True)
    assert "is a directory" in output_problem(tmp_path, hf=False, overwrite=True)
