"""Token shards on disk: windows over several shards, the sampler's world-size-independent order over
them, the prefetching reader's exact position, and one-line refusals of damaged datasets."""

import os

import numpy as np
import pytest
import torch
from helpers import write_token_dataset

from distrain.artifacts.token_dataset import inspect_token_dataset as check_dataset
from distrain.data.sampler import GlobalBatchSampler, TrainBatches, token_windows
from distrain.data.token_format import DataError, read_index
from distrain.data.tokens import data_vocab_size, largest_token_id, token_corpus

SHARDS = [np.arange(0, 50) % 200, np.arange(50, 71) % 200, np.arange(100, 161) % 200]  # 50, 21, 61 tokens


@pytest.fixture
def dataset(tmp_path):
    return write_token_dataset(tmp_path / "data", {"train": SHARDS, "val": [np.arange(30)]}, vocab_size=200)


def test_windows_never_cross_a_shard_and_come_out_as_stored(dataset):
    windows = token_windows(token_corpus(str(dataset)).train, seq_len=10)
    assert len(windows) == 4 + 2 + 6  # (n - 1) // seq_len per shard
    batch = windows.batch(torch.tensor([0, 4, 5, 6, 11]))
    expected_starts = [0, 50, 60, 100, 150]  # shard 0 window 0; shard 1 windows 0-1; shard 2 windows 0 and 5
    assert [row[0] for row in batch.inputs.tolist()] == expected_starts
    assert batch.inputs.dtype == torch.int64
    assert torch.equal(batch.targets[:, :-1], batch.inputs[:, 1:])
    assert batch.targets[4].tolist() == list(range(151, 161))


def test_one_and_two_ranks_read_the_same_global_batch(dataset):
    windows = token_windows(token_corpus(str(dataset)).train, seq_len=5)

    def reader(rank, ranks, micro):
        sampler = GlobalBatchSampler(
            num_samples=len(windows), micro_batch_size=micro, grad_accum_steps=1, dp_rank=rank, dp_size=ranks, seed=3
        )
        return TrainBatches(windows, sampler, prefetch=True)

    one, two = reader(0, 1, 4), [reader(rank, 2, 2) for rank in range(2)]
    for _ in range(12):  # several epochs
        single = one.next_step()[0].inputs.tolist()
        split = [row for r in two for row in r.next_step()[0].inputs.tolist()]
        assert split == single


def test_prefetching_keeps_the_position_of_the_last_step_returned(dataset):
    windows = token_windows(token_corpus(str(dataset)).train, seq_len=5)

    def reader(prefetch):
        sampler = GlobalBatchSampler(
            num_samples=len(windows), micro_batch_size=2, grad_accum_steps=2, dp_rank=0, dp_size=1, seed=0
        )
        return TrainBatches(windows, sampler, prefetch=prefetch)

    plain, ahead = reader(False), reader(True)
    for _ in range(7):
        assert [b.inputs.tolist() for b in plain.next_step()] == [b.inputs.tolist() for b in ahead.next_step()]
        assert plain.state_dict() == ahead.state_dict()
    saved = ahead.state_dict()
    expected = [[b.inputs.tolist() for b in ahead.next_step()] for _ in range(5)]
    resumed = reader(True)
    resumed.next_step()  # a reader that already prefetched elsewhere
    resumed.load_state_dict(saved)
    assert [[b.inputs.tolist() for b in resumed.next_step()] for _ in range(5)] == expected
    ahead.close()


def test_vocabulary_and_largest_id_come_from_the_index(dataset):
    assert data_vocab_size(str(dataset)) == 200
    assert largest_token_id(str(dataset)) == 160
    assert data_vocab_size(str(dataset / "nope")) is None


def test_nanogpt_bins_are_one_shard_splits(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (np.arange(100, dtype=np.uint16) + 5000).tofile(tmp_path / "val.bin")
    index = read_index(tmp_path, "train")
    assert (index.tokens, index.vocab_size, len(index.shards)) == (1000, 5100, 1)
    corpus = token_corpus(str(tmp_path))
    assert token_windows(corpus.val, 9).batch(torch.tensor([1])).inputs.tolist() == [list(range(5009, 5018))]
    check_dataset(str(tmp_path), checksums=True)


@pytest.mark.parametrize(
    "damage,words",
    [
        ("odd_size", "is not a whole number of uint16 token ids"),
        ("longer", "holds 22 tokens, its index says 21"),
        ("changed", "its SHA-256 differs from train.json's"),
        ("missing", "missing (named by train.json)"),
        ("bad_index", "an unreadable index"),
        ("bad_tokenizer", "an unreadable tokenizer"),
    ],
)
def test_damaged_datasets_are_refused_naming_the_file(dataset, damage, words):
    shard = dataset / "train-00001.bin"
    if damage == "odd_size":
        shard.write_bytes(shard.read_bytes() + b"x")
    elif damage == "longer":
        shard.write_bytes(shard.read_bytes() + b"xy")
    elif damage == "changed":
        shard.write_bytes(b"zz" + shard.read_bytes()[2:])
    elif damage == "missing":
        shard.unlink()
    elif damage == "bad_index":
        (dataset / "train.json").write_text("{not json")
    elif damage == "bad_tokenizer":
        body = (dataset / "train.json").read_text().replace('"tokenizer": null', '"tokenizer": "tokenizer.json"')
        (dataset / "train.json").write_text(body)
        (dataset / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError) as refused:
        check_dataset(str(dataset), checksums=True)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_a_failed_read_is_raised_once_and_a_rollback_reads_again(dataset):
    windows = token_windows(token_corpus(str(dataset)).train, seq_len=5)
    failures = {"left": 1}

    class Flaky:
        def __len__(self):
            return len(windows)

        def batch(self, indices):
            if failures["left"] and len(indices) and int(indices[0]) >= 0:
                failures["left"] -= 1
                raise OSError("disk hiccup")
            return windows.batch(indices)

    sampler = GlobalBatchSampler(
        num_samples=len(windows), micro_batch_size=2, grad_accum_steps=1, dp_rank=0, dp_size=1, seed=0
    )
    reader = TrainBatches(Flaky(), sampler, prefetch=True)
    before = reader.state_dict()
    with pytest.raises(OSError, match="disk hiccup"):
        reader.next_step()
    reader.load_state_dict(before)  # the loop's rollback of a failed step: must not raise the old error again
    first = reader.next_step()[0].inputs.tolist()
    fresh = TrainBatches(windows, GlobalBatchSampler(
        num_samples=len(windows), micro_batch_size=2, grad_accum_steps=1, dp_rank=0, dp_size=1, seed=0
    ))  # fmt: skip
    assert first == fresh.next_step()[0].inputs.tolist()
    reader.close()


def test_the_longest_sequence_is_limited_by_the_largest_shard(dataset):
    from distrain.data.sampler import longest_window

    assert longest_window(token_corpus(str(dataset)).train) == 60  # shards of 50, 21, 61 tokens


def test_verified_shards_are_not_hashed_again_until_they_change(dataset, tmp_path, monkeypatch):
    """The SHA-256 check of every shard (the default) reads a dataset once per version of its shards."""
    from distrain.data import token_format

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    hashed = []
    monkeypatch.setattr(token_format, "sha256_of", lambda path, **_: hashed.append(path.name) or _sha256(path))
    old = 1_000_000_000_000_000_000  # 2001: well before now, so no shard is too fresh to record
    for shard in dataset.glob("*.bin"):
        os.utime(shard, ns=(old, old))
    check_dataset(str(dataset), checksums=True)
    assert sorted(hashed) == sorted(path.name for path in dataset.glob("*.bin"))
    hashed.clear()
    check_dataset(str(dataset), checksums=True)
    assert hashed == []  # unchanged: not read again
    changed = dataset / "train-00001.bin"
    data = bytearray(changed.read_bytes())
    data[0] ^= 1
    changed.write_bytes(bytes(data))  # same size; its modification time moves
    with pytest.raises(DataError, match="train-00001.bin: its SHA-256 differs"):
        check_dataset(str(dataset), checksums=True)
    assert hashed == ["train-00001.bin"]


def _sha256(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
