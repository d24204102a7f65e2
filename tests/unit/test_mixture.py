"""data=mix: the sampler draws each source in proportion to its weight (within one sequence at every step), lays the
global batch out as one dataset's is (the same sequences on 1, 2 or 4 ranks), resumes exactly, and reads each row
from its own source; bad mixtures are refused in one line naming the source."""

import numpy as np
import pytest
import torch
from helpers import compose_config, write_token_dataset

from distrain.config.checks import ConfigError
from distrain.config.validate import validate
from distrain.data.mixture import MixtureSplit

WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}
SIZES = {"web": 50, "code": 20, "math": 3}  # windows of 8 tokens; math repeats every 3 draws


def split(weights=WEIGHTS, seq_len=8):
    """Each source's tokens hold its own id (web 1, code 2, math 3): a row says where it was read from."""
    streams = {name: torch.full((SIZES[name] * seq_len + 1,), number + 1) for number, name in enumerate(weights)}
    return MixtureSplit(streams, dict(weights)).windows(seq_len)


def sampler(windows, dp_rank=0, dp_size=1, micro_batch_size=4, grad_accum_steps=2, seed=7):
    settings = dict(micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps, seed=seed)
    return windows.sampler(dp_rank=dp_rank, dp_size=dp_size, **settings)


def source_of(windows, index):
    return windows.names[int(np.searchsorted(windows.offsets, index, side="right")) - 1]


def test_every_step_keeps_each_source_within_one_sequence_of_its_share():
    windows = split()
    drawing = sampler(windows)
    for step in range(1, 40):
        drawing.next_step()
        drawn = drawing.state_dict()["drawn"]
        total = step * drawing.global_batch_size
        for name, weight in WEIGHTS.items():
            assert abs(drawn[name] - weight * total) < 1, (step, drawn)
    fractions = drawing.fractions(drawing.state_dict())
    assert fractions == pytest.approx({f"data/{name}/fraction": w for name, w in WEIGHTS.items()}, abs=1e-2)


def test_the_global_batch_is_the_same_sequences_on_1_2_or_4_ranks():
    windows = split()

    def global_batches(dp_size):
        ranks = [sampler(windows, rank, dp_size, micro_batch_size=8 // dp_size) for rank in range(dp_size)]
        return [sorted(torch.cat([torch.cat(r.next_step()) for r in ranks]).tolist()) for _ in range(6)]

    assert global_batches(1) == global_batches(2) == global_batches(4)


def test_resume_continues_with_the_next_sequences():
    windows = split()
    whole, first = sampler(windows), sampler(windows)
    for _ in range(5):
        whole.next_step()
        first.next_step()
    resumed = sampler(windows)
    resumed.load_state_dict(first.state_dict())
    for _ in range(7):
        assert all(torch.equal(a, b) for a, b in zip(whole.next_step(), resumed.next_step(), strict=True))


def test_each_source_goes_through_its_windows_once_per_epoch_and_a_weight_of_zero_draws_none():
    windows = split({"web": 0.6, "code": 0.4, "math": 0.0})
    drawing = sampler(windows)
    drawn = torch.cat([torch.cat(drawing.next_step()) for _ in range(5)]).tolist()  # 40 sequences
    by_source = {name: [i for i in drawn if source_of(windows, i) == name] for name in windows.names}
    assert not by_source["math"] and len(by_source["code"]) == 16
    assert len(set(by_source["web"])) == 24  # 24 of its 50 windows: no repeat inside an epoch
    assert len(set(by_source["code"])) == 16


def test_a_batch_reads_each_row_from_its_own_source():
    windows = split()
    indices = torch.cat(sampler(windows).next_step())
    batch = windows.batch(indices)
    expected = [windows.names.index(source_of(windows, i)) + 1 for i in indices.tolist()]
    assert batch.inputs[:, 0].tolist() == expected and (batch.inputs == batch.inputs[:, :1]).all()


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    ids = np.arange(4000) % 200

    def dataset(name, vocab_size=256, val=ids[:500]):
        return write_token_dataset(root / name, {"train": [ids], "val": [val]}, vocab_size=vocab_size)

    return {
        "a": dataset("a"),
        "b": dataset("b"),
        "other_vocabulary": dataset("other", vocab_size=512),
        "short_val": dataset("short", val=ids[:20]),
    }


def mix(**sources):
    listed = ",".join(f"{name}:{{path:{path},weight:{weight}}}" for name, (path, weight) in sources.items())
    return compose_config(["data=mix", f"data.sources={{{listed}}}", "data.seq_len=64", "model.n_layers=1"])


def test_a_mixture_of_two_datasets_passes(datasets):
    validate(mix(a=(datasets["a"], 0.7), b=(datasets["b"], 0.3)))


@pytest.mark.parametrize(
    "sources,line",
    [
        ({"a": ("a", -1), "b": ("b", 1)}, "data.sources.a.weight=-1 is not allowed: a finite number >= 0"),
        ({"a": ("a", "nan"), "b": ("b", 1)}, "data.sources.a.weight=nan is not allowed: a finite number >= 0"),
        ({"a": ("a", "inf"), "b": ("b", 1)}, "data.sources.a.weight=inf is not allowed: a finite number >= 0"),
        ({"a": ("a", 1e308), "b": ("b", 1e308)}, "data.sources='weights summing past 1e308' is not allowed"),
        ({"a": ("a", 0), "b": ("b", 0)}, "data.sources='every weight 0' is not allowed: at least one source"),
        ({"a": ("a", 1), "b": ("missing", 1)}, "data.sources.b.path="),
        ({"a": ("a", 1), "b": ("other_vocabulary", 1)}, "ids of different tokenizers cannot be mixed"),
        ({"a": ("a", 1), "b": ("short_val", 1)}, "a dataset whose val split holds a window of data.seq_len + 1 = 65"),
    ],
)
def test_a_bad_mixture_is_refused_in_one_line(datasets, tmp_path, sources, line):
    paths = {name: (datasets.get(key, tmp_path / key), weight) for name, (key, weight) in sources.items()}
    with pytest.raises(ConfigError) as refused:
        validate(mix(**paths))
    assert line in str(refused.value) and "\n" not in str(refused.value)


def test_a_source_without_a_path_or_with_an_unknown_key_is_refused_and_the_weight_defaults_to_one(datasets):
    given = f"a:{{path:{datasets['a']}}}"
    validate(compose_config(["data=mix", f"data.sources={{{given}}}", "data.seq_len=64"]))  # weight 1
    for sources, line in (
        ("{a:{weight:1}}", "data.sources.a.path=null is not allowed: a prepared dataset directory"),
        (f"{{a:{{path:{datasets['a']},wieght:1}}}}", "a mapping of path and weight (no wieght:"),
        ("{a:3}", "data.sources.a=3 is not allowed: a mapping of path and weight"),
    ):
        with pytest.raises(ConfigError) as refused:
            validate(compose_config(["data=mix", f"data.sources={sources}", "data.seq_len=64"]))
        assert line in str(refused.value), str(refused.value)


def test_random_weights_keep_every_source_within_about_one_sequence_of_its_share():
    generator = np.random.default_rng(0)
    worst = 0.0
    for _ in range(30):
        count = int(generator.integers(2, 8))
        raw = generator.random(count)
        weights = {f"s{i}": float(w / raw.sum()) for i, w in enumerate(raw)}
        streams = {name: torch.zeros(50 * 8 + 1, dtype=torch.long) for name in weights}
        drawing = (
            MixtureSplit(streams, weights)
            .windows(8)
            .sampler(micro_batch_size=7, grad_accum_steps=1, dp_rank=0, dp_size=1, seed=0)
        )
        for step in range(1, 30):
            drawing.next_step()
            drawn = drawing.state_dict()["drawn"]
            worst = max(worst, *(abs(drawn[name] - w * 7 * step) for name, w in weights.items()))
    assert worst < 1.5, worst  # 1.15 measured: the docs' "about one sequence"


def with_tokenizer(directory, vocab_size):
    """``directory``'s indexes name a tokenizer.json trained here (its content depends on ``vocab_size``)."""
    import dataclasses

    from helpers import save_tiny_tokenizer

    from distrain.data.token_format import read_index, write_index

    save_tiny_tokenizer(directory, vocab_size)
    for split in ("train", "val"):
        write_index(directory, dataclasses.replace(read_index(directory, split), tokenizer="tokenizer.json"))
    return directory


def test_sources_made_with_different_tokenizer_files_or_one_without_are_refused(tmp_path):
    ids = np.arange(4000) % 200
    made = {
        name: write_token_dataset(tmp_path / name, {"train": [ids], "val": [ids[:500]]}) for name in ("a", "b", "c")
    }
    with_tokenizer(made["a"], 256)
    with_tokenizer(made["b"], 300)
    for other, words in (("b", "tokenizer.json differs from"), ("c", "one was made with a tokenizer file")):
        with pytest.raises(ConfigError) as refused:
            validate(mix(a=(made["a"], 1), **{other: (made[other], 1)}))
        assert f"data.sources.{other}.path=" in str(refused.value) and words in str(refused.value)


def test_the_model_vocabulary_is_checked_against_the_sources_largest_id(tmp_path):
    ids = np.arange(4000) % 65  # a character-level vocabulary, smaller than bytes
    small = {n: write_token_dataset(tmp_path / n, {"train": [ids], "val": [ids[:500]]}, 65) for n in ("a", "b")}
    validate(mix(a=(small["a"], 1), b=(small["b"], 1)))  # the model takes the data's 65
    wide = np.arange(4000) % 1000
    large = write_token_dataset(tmp_path / "large", {"train": [wide], "val": [wide[:500]]}, 1024)
    cfg = compose_config(
        ["data=mix", f"data.sources={{l:{{path:{large}}}}}", "data.seq_len=64", "model.vocab_size=512"]
    )
    with pytest.raises(ConfigError, match="model.vocab_size=512 is not allowed"):
        validate(cfg)


def test_a_dry_run_plans_a_mixture(datasets):
    from distrain.planning.dry_run import plan

    target = ["target.device=cuda", "target.nodes=1", "target.ranks_per_node=2", "dry_run=true"]
    listed = f"a:{{path:{datasets['a']},weight:0.5}},b:{{path:{datasets['b']},weight:0.5}}"
    report = plan(compose_config(["data=mix", f"data.sources={{{listed}}}", "data.seq_len=64", *target]))
    assert report.global_batch_size == 16 and report.steps_per_epoch == (2 * (3999 // 64)) // 16


def test_a_resume_with_new_weights_follows_them_from_there_on():
    windows = split()
    first = sampler(windows)
    for _ in range(10):
        first.next_step()
    changed = {"web": 0.2, "code": 0.2, "math": 0.6}
    resumed = MixtureSplit({n: torch.zeros(SIZES[n] * 8 + 1, dtype=torch.long) for n in changed}, changed).windows(8)
    drawing = sampler(resumed)
    drawing.load_state_dict(first.state_dict())
    before = dict(drawing.state_dict()["drawn"])
    for _ in range(10):
        drawing.next_step()
    after = drawing.state_dict()["drawn"]
    added = {name: after[name] - before[name] for name in changed}  # 80 sequences since the resume
    assert added == {name: round(w * 80) for name, w in changed.items()}, added
    again = sampler(resumed)  # a second resume with the same new weights keeps counting from the first
    again.load_state_dict(drawing.state_dict())
    assert again.state_dict()["since"] == drawing.state_dict()["since"] == before
