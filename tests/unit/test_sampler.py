import torch

from distrain.data.sampler import GlobalBatchSampler, TokenWindows, validation_batches


def make(rank, size, micro=2, accum=1, n=50, seed=0):
    return GlobalBatchSampler(
        num_samples=n, micro_batch_size=micro, grad_accum_steps=accum, dp_rank=rank, dp_size=size, seed=seed
    )


def step_union(samplers):
    return sorted(torch.cat([idx for s in samplers for idx in s.next_step()]).tolist())


def test_no_sample_repeats_within_an_epoch_across_ranks_and_micro_steps():
    samplers = [make(r, 2, micro=3, accum=2) for r in range(2)]
    seen = []
    for _ in range(samplers[0].num_samples // samplers[0].global_batch_size):
        seen += step_union(samplers)
    assert len(seen) == len(set(seen)) == samplers[0].num_samples // samplers[0].global_batch_size * 12


def test_global_batch_does_not_depend_on_how_it_is_split():
    two_ranks = [make(r, 2, micro=2) for r in range(2)]
    accumulate = [make(0, 1, micro=2, accum=2)]
    one_big = [make(0, 1, micro=4)]
    for _ in range(30):  # crosses epoch boundaries (12 steps per epoch)
        assert step_union(two_ranks) == step_union(accumulate) == step_union(one_big)


def test_epochs_are_reshuffled_and_seed_matters():
    s = make(0, 1, micro=5, n=20)
    epoch0 = [s.next_step()[0].tolist() for _ in range(4)]
    epoch1 = [s.next_step()[0].tolist() for _ in range(4)]
    assert s.epoch == 1
    assert sorted(sum(epoch0, [])) == sorted(sum(epoch1, [])) == list(range(20))
    assert epoch0 != epoch1
    assert make(0, 1, micro=5, n=20, seed=1).next_step()[0].tolist() != epoch0[0]


def test_position_restores_exactly():
    s = make(1, 2, micro=2, accum=2)
    for _ in range(17):
        s.next_step()
    saved = s.state_dict()
    expected = [[t.tolist() for t in s.next_step()] for _ in range(10)]
    restored = make(1, 2, micro=2, accum=2)
    restored.load_state_dict(saved)
    assert [[t.tolist() for t in restored.next_step()] for _ in range(10)] == expected


def test_windows_are_next_token_pairs():
    tokens = torch.arange(100, dtype=torch.uint8)
    windows = TokenWindows(tokens, seq_len=8)
    assert len(windows) == 12
    batch = windows.batch(torch.tensor([0, 3]))
    assert batch.inputs[1].tolist() == list(range(24, 32))
    assert batch.targets[1].tolist() == list(range(25, 33))
    assert batch.inputs.dtype == torch.int64


def test_validation_batches_are_disjoint_across_ranks():
    windows = TokenWindows(torch.arange(1000) % 256, seq_len=4)
    parts = [validation_batches(windows, micro_batch_size=3, num_batches=2, dp_rank=r, dp_size=2) for r in range(2)]
    rows = [tuple(row.tolist()) for part in parts for b in part for row in b.inputs]
    assert len(rows) == len(set(rows)) == 12


def test_position_carries_over_to_another_world_size():
    """Saved on 2 ranks, resumed on 4 (same global batch): the same samples come next, split differently."""
    two = [make(r, 2, micro=4) for r in range(2)]
    for _ in range(5):
        step_union(two)
    four = [make(r, 4, micro=2) for r in range(4)]
    for sampler in four:
        sampler.load_state_dict(two[0].state_dict())
    for _ in range(10):  # crosses an epoch boundary
        assert step_union(four) == step_union(two)


def test_limit_batches_trains_on_the_same_global_batch_every_step():
    """trainer.overfit_batches=1: every step is the first global batch's windows again, however it is split."""

    def limited(rank, size, micro, accum=1):
        return GlobalBatchSampler(
            num_samples=50,
            micro_batch_size=micro,
            grad_accum_steps=accum,
            dp_rank=rank,
            dp_size=size,
            seed=0,
            limit_batches=1,
        )

    two_ranks = [limited(r, 2, micro=3) for r in range(2)]
    first = step_union(two_ranks)
    assert len(first) == len(set(first)) == 6 and two_ranks[0].num_samples == 6
    for _ in range(20):  # each step is its own epoch: the same set, in a new order
        assert step_union(two_ranks) == first
    assert two_ranks[0].epoch == 20
    assert step_union([limited(0, 1, micro=3, accum=2)]) == first  # split another way: the same windows
    two = [limited(r, 2, micro=3) for r in range(2)]
    two[0].load_state_dict(two_ranks[0].state_dict())  # and after a resume
    assert sorted(torch.cat(two[0].next_step()).tolist()) == sorted(torch.cat(two_ranks[0].next_step()).tolist())


def test_limit_batches_n_cycles_over_n_global_batches():
    sampler = GlobalBatchSampler(
        num_samples=50, micro_batch_size=2, grad_accum_steps=1, dp_rank=0, dp_size=1, seed=0, limit_batches=3
    )
    seen = {index for _ in range(30) for index in sampler.next_step()[0].tolist()}
    assert seen == set(range(6))
    unlimited = GlobalBatchSampler(
        num_samples=50, micro_batch_size=2, grad_accum_steps=1, dp_rank=0, dp_size=1, seed=0, limit_batches=0
    )
    assert unlimited.num_samples == 50
