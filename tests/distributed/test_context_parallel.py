"""Load-balanced context-parallel attention on real gloo ranks: every rank's logits equal the single-process model's
at that rank's global positions, and the parameter gradients summed over the context-parallel ranks equal the
single-process gradients (cp=2 on 2 ranks; cp=4, and two cp=2 groups side by side, on 4 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import join, leave, on_ranks

from distrain.models.llama.model import Llama
from distrain.models.spec import next_token_loss, spec_of
from distrain.parallelism.context import ContextParallel, load_balanced_positions, shard_sequence

VOCAB, SEQ, BATCH = 64, 16, 2


def tiny_llama() -> Llama:
    torch.manual_seed(0)  # the same weights on every rank
    model = Llama(
        vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
        rope_theta=10000.0,
    )  # fmt: skip
    # A larger init than the default 0.02 makes attention far from uniform, so misplaced keys change the logits.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.1)
    return model


def token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


# ----------------------------------------------------------------------------------- positions (no ranks)


def test_positions_pair_an_early_chunk_with_its_mirror():
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert load_balanced_positions(8, 1, 0).tolist() == list(range(8))
    assert load_balanced_positions(8, 2, 0).dtype == torch.long


@pytest.mark.parametrize("seq_len,cp", [(8, 2), (16, 4), (24, 3), (12, 1)])
def test_positions_of_all_ranks_are_a_permutation(seq_len, cp):
    held = torch.cat([load_balanced_positions(seq_len, cp, rank) for rank in range(cp)])
    assert sorted(held.tolist()) == list(range(seq_len))
    sizes = {len(load_balanced_positions(seq_len, cp, rank)) for rank in range(cp)}
    assert sizes == {seq_len // cp}


def test_bad_sequence_length_is_refused_by_name():
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2 \* cp = 4"):
        load_balanced_positions(10, 2, 0)
    with pytest.raises(ValueError, match="sequence length 6"):
        shard_sequence(torch.zeros(1, 6), 2, 1)
    with pytest.raises(ValueError, match="rank 2"):
        load_balanced_positions(8, 2, 2)


def test_shard_sequence_takes_the_positions_along_the_sequence_dimension():
    ids = torch.arange(16).view(2, 8)
    assert shard_sequence(ids, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    hidden = torch.arange(8).view(1, 8, 1).expand(3, 8, 5)
    assert shard_sequence(hidden, 2, 0)[:, :, 0].tolist() == [[0, 1, 6, 7]] * 3


def test_context_of_one_rank_is_exactly_the_plain_model():
    model = tiny_llama()
    inputs, _ = token_batch()
    plain = model(inputs)
    spec_of(model).context_parallel(model, ContextParallel(group=None, size=1, rank=0))
    assert all(block.attention.context is not None for block in model.layers.values())
    assert torch.equal(model(inputs), plain)


# ----------------------------------------------------------------------------------- on real ranks


def context_parallel_run(layouts: list[list[list[int]]]) -> list[dict[str, float]]:
    """On every rank, for each layout (a partition of the ranks into context-parallel groups): the full model's
    logits and gradients, then the same with this rank's group feeding its share of the sequence; the errors."""
    env = join(None)
    try:
        results = []
        for groups in layouts:
            handles = [dist.new_group(ranks) for ranks in groups]  # every rank creates every group, in one order
            index = next(i for i, ranks in enumerate(groups) if env.rank in ranks)
            results.append(compare_with_full_model(handles[index], groups[index].index(env.rank), len(groups[index])))
        return results
    finally:
        leave()


def compare_with_full_model(group: dist.ProcessGroup, rank: int, cp: int) -> dict[str, float]:
    model = tiny_llama()
    inputs, targets = token_batch()
    full_logits = model(inputs)
    next_token_loss(full_logits, targets).backward()
    full_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    local_inputs, local_targets = shard_sequence(inputs, cp, rank), shard_sequence(targets, cp, rank)
    expected = full_logits.detach()[:, load_balanced_positions(SEQ, cp, rank)]
    with torch.no_grad():  # no context: the shard read as if it were a sequence starting at position 0
        unaware = model(local_inputs)

    with torch.no_grad():  # every rank gathers as it should but places its own tokens at the next rank's positions
        spec_of(model).context_parallel(model, ContextParallel(group=group, size=cp, rank=(rank + 1) % cp))
        misplaced = model(local_inputs)

    spec_of(model).context_parallel(model, ContextParallel(group=group, size=cp, rank=rank))
    logits = model(local_inputs)
    next_token_loss(logits, local_targets).backward()
    own_grad_error = max((p.grad - full_grads[n]).abs().max().item() for n, p in model.named_parameters())
    for param in model.parameters():
        dist.all_reduce(param.grad, group=group)
    return {
        "cp": cp,
        "logit_error": (logits.detach() - expected).abs().max().item(),
        "unaware_error": (unaware - expected).abs().max().item(),
        "misplaced_error": (misplaced - expected).abs().max().item(),
        "grad_error": max((p.grad - full_grads[n]).abs().max().item() for n, p in model.named_parameters()),
        "own_grad_error": own_grad_error,
        "grad_scale": max(g.abs().max().item() for g in full_grads.values()),
    }


LAYOUTS = {  # name: (world size, the ranks' partition into context-parallel groups)
    "cp2": (2, [[0, 1]]),
    "cp4": (4, [[0, 1, 2, 3]]),
    "cp2_subgroups": (4, [[0, 2], [1, 3]]),  # group ranks differ from global ranks
}


@pytest.fixture(scope="module")
def results():
    """{layout: [result of each rank]}, from one launch per world size."""
    found = {}
    for world in sorted({world for world, _ in LAYOUTS.values()}):
        names = [name for name, (size, _) in LAYOUTS.items() if size == world]
        per_rank = on_ranks(context_parallel_run, world, [LAYOUTS[name][1] for name in names])
        found.update({name: [per_rank[r][i] for r in range(world)] for i, name in enumerate(names)})
    return found


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_equal_the_full_model_at_each_ranks_positions(results, layout):
    for rank, result in enumerate(results[layout]):
        assert result["logit_error"] < 1e-5, f"{layout} rank {rank}: max |logit - full| = {result['logit_error']}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_with_wrong_positions_differ(results, layout):
    # The check above would catch wrong positions: the shard read without the context, or with the context of
    # another rank (its positions), gives other logits.
    for rank, result in enumerate(results[layout]):
        assert result["unaware_error"] > 1e-2, f"{layout} rank {rank}: {result['unaware_error']}"
        assert result["misplaced_error"] > 1e-2, f"{layout} rank {rank}: {result['misplaced_error']}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradients_summed_over_the_group_equal_the_full_model(results, layout):
    for rank, result in enumerate(results[layout]):
        assert result["grad_error"] < 1e-5, f"{layout} rank {rank}: max |grad - full| = {result['grad_error']}"
        # One rank's own gradient is a part of the whole: the sum above is what makes it exact.
        assert result["own_grad_error"] > 1e-3 * result["grad_scale"]
        assert result["cp"] == (4 if layout == "cp4" else 2)


def built_strategy_split(cfg_dict):
    """On each rank: train.py's build of a cp=2 layout; what its model receives and what its attention holds."""
    import tempfile

    from omegaconf import OmegaConf

    from distrain.trainer.build import build

    env = join(None)
    try:
        cfg = OmegaConf.create(cfg_dict)
        run = build(cfg, env, run_dir=tempfile.mkdtemp())
        (batch,) = run.data.next_step()
        local = run.strategy._local_part(batch)
        contexts = [m.context for m in run.strategy.unwrapped.modules() if hasattr(m, "n_rep")]
        run.data.close()
        positions = local.inputs.shape[1], batch.inputs.shape[1]
        return positions, [(c.size, c.rank) if c is not None else None for c in contexts]
    finally:
        leave()


def test_train_py_build_of_cp2_feeds_each_rank_half_of_every_sequence():
    """The strategy, not the test, splits the sequence: a cp=2 build gives each rank seq_len / 2 tokens and every
    attention module the context of its own cp rank (a no-op wiring would still match one process's losses)."""
    from helpers import FAST, compose_config, to_plain

    overrides = [*FAST, "model=llama_tiny", "parallelism=hybrid", "parallelism.cp=2", "distributed.nproc_per_node=2"]
    cfg = to_plain(compose_config(overrides))
    per_rank = on_ranks(built_strategy_split, 2, cfg)
    for rank in (0, 1):
        (local, whole), contexts = per_rank[rank]
        assert (local, whole) == (16, 32)
        assert contexts and all(context == (2, rank) for context in contexts)
