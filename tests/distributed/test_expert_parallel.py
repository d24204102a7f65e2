"""Expert parallelism on gloo ranks: each rank's logits, expert gradients and routing counts equal one process's on its
batch, also when a rank receives no token (fp32 and bf16 autocast); the all-to-all byte counters; 3 AdamW steps with
FSDP2 over the rest and gradient clipping across both meshes follow one process training the full model on the
batches concatenated (ep=2 on 2 ranks, and ep=2 with two replica groups on 4); a torch.distributed.checkpoint of the
EP model loads into one full model."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from helpers import join, leave, on_ranks
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from distrain.models.moe.expert_parallel import (
    EXPERT_WEIGHTS,
    all_to_all_bytes,
    expert_parameters,
    parallelize_experts,
    sync_expert_gradients,
)
from distrain.models.moe.model import MoE, MoEFeedForward
from distrain.models.moe.spec import auxiliary_loss, moe_layers
from distrain.parallelism.gradients import clip_grad_norm_across_meshes

CONFIG = dict(
    vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, expert_hidden=24, n_experts=4, top_k=2
)  # fmt: skip
BATCH, SEQ, STEPS = 4, 16, 3
MAX_NORM = 0.5  # below the first steps' gradient norms (about 0.74): clipping is active


def _model():
    torch.manual_seed(0)
    return MoE(**CONFIG)


def _batch(index):
    return torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(10 + index))


def _next_token_loss(logits, batch):
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _experts_of(model, local):
    """{'layer.w1': tensor}: the local shards (EP) or the full weights' gradients (one process)."""
    out = {}
    for i, layer in enumerate(moe_layers(model)):
        for name in EXPERT_WEIGHTS:
            grad = getattr(layer, name).grad
            out[f"{i}.{name}"] = (grad.to_local() if local else grad).detach().clone()
    return out


def _ep_forward_backward(ep_mesh):
    """One forward and backward of (next-token loss + auxiliary loss) on this rank's batch, then the gradient sync."""
    model = _model()
    full_count = sum(p.numel() for p in _plain_expert_weights(model))
    parallelize_experts(model, ep_mesh)
    batch = _batch(dist.get_rank())
    logits = model(batch[:, :-1])
    (_next_token_loss(logits, batch) + auxiliary_loss(model)).backward()
    sync_expert_gradients(model)
    return {
        "logits": logits.detach(),
        "grads": _experts_of(model, local=True),
        "counts": [layer.last_tokens_per_expert.clone() for layer in moe_layers(model)],
        "bytes": all_to_all_bytes(model),
        "bytes_after_reset": all_to_all_bytes(model),
        "local_count": sum(p.to_local().numel() for p in expert_parameters(model)),
        "full_count": full_count,
        "all_dtensor": all(isinstance(p, DTensor) for p in expert_parameters(model)),
    }


def _skewed_ffn():
    """A layer whose router sends every token (with x[..., 0] == 1) to experts 0 and 1: rank 1 of ep=2 gets none."""
    torch.manual_seed(0)
    ffn = MoEFeedForward(32, 24, 4, 2)
    with torch.no_grad():
        ffn.router.weight.zero_()
        ffn.router.weight[:2, 0] = 20.0
    return ffn


def _skewed_input(rank):
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(rank))
    x[..., 0] = 1.0
    return x.requires_grad_()


def _rank_without_tokens(ep_mesh):
    """Outputs, input and expert gradients of the skewed layer in fp32, then under bf16 autocast."""
    results = []
    for autocast in (False, True):
        ffn, x = _skewed_ffn(), _skewed_input(dist.get_rank())
        parallelize_experts(ffn, ep_mesh)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ffn(x)
        out.float().square().mean().backward()
        sync_expert_gradients(ffn)
        grads = {name: getattr(ffn, name).grad.to_local().clone() for name in EXPERT_WEIGHTS}
        results.append({"out": out.detach().float(), "x_grad": x.grad.clone(), "grads": grads})
    return results


def _refusals(ep_mesh):
    """parallelize_experts' refusals: experts that do not split over ep, a second application, no MoE layer."""
    messages, twice = [], MoEFeedForward(32, 24, 4, 2)
    parallelize_experts(twice, ep_mesh)
    for module in (MoEFeedForward(32, 24, 3, 2), twice, torch.nn.Linear(2, 2)):
        try:
            parallelize_experts(module, ep_mesh)
        except ValueError as err:
            messages.append(str(err))
    return messages


def _plain_expert_weights(model):
    return [getattr(layer, name) for layer in moe_layers(model) for name in EXPERT_WEIGHTS]


def _train(dp_mesh, ep_mesh, replicas_group, checkpoint_dir=None):
    """STEPS AdamW steps with EP and FSDP2 (each block and the root, the experts ignored); this rank's losses, the
    first step's expert-gradient shards, and (with ``checkpoint_dir``) a DCP save and every weight in full."""
    model = _model()
    parallelize_experts(model, ep_mesh, replicas_group)
    ignored = expert_parameters(model)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, ignored_params=ignored)
    fully_shard(model, mesh=dp_mesh, ignored_params=ignored)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch, losses, norms, first_grads = _batch(dist.get_rank()), [], [], None
    for _ in range(STEPS):
        loss = _next_token_loss(model(batch[:, :-1]), batch)
        loss.backward()
        sync_expert_gradients(model)
        first_grads = first_grads or _experts_of(model, local=True)
        norms.append(clip_grad_norm_across_meshes(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    result = {"losses": losses, "norms": norms, "first_grads": first_grads}
    if checkpoint_dir is not None:
        dcp.save(get_model_state_dict(model), checkpoint_id=checkpoint_dir)
        result["weights"] = {name: param.full_tensor().detach() for name, param in model.named_parameters()}
    return result


def _on_two_ranks(checkpoint_dir):
    join(None)
    try:
        ep_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        dp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        return {
            "step": _ep_forward_backward(ep_mesh),
            "empty": _rank_without_tokens(ep_mesh),
            "refusals": _refusals(ep_mesh),
            "train": _train(dp_mesh, ep_mesh, None, checkpoint_dir),
        }
    finally:
        leave()


def _on_four_ranks(checkpoint_dir):
    join(None)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "ep"))
        dp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        return _train(dp_mesh, mesh["ep"], mesh["replica"].get_group(), checkpoint_dir)
    finally:
        leave()


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory):
    return {world_size: str(tmp_path_factory.mktemp(f"ep_checkpoint_{world_size}_ranks")) for world_size in (2, 4)}


@pytest.fixture(scope="module")
def two_ranks(checkpoint_dirs):
    return on_ranks(_on_two_ranks, 2, checkpoint_dirs[2])


@pytest.fixture(scope="module")
def four_ranks(checkpoint_dirs):
    return on_ranks(_on_four_ranks, 4, checkpoint_dirs[4])


def _single_process_training(n_batches):
    """Losses and first-step expert gradients of one process training the full model on the batches concatenated."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch, losses, norms, first_grads = torch.cat([_batch(i) for i in range(n_batches)]), [], [], None
    for _ in range(STEPS):
        loss = _next_token_loss(model(batch[:, :-1]), batch)
        loss.backward()
        first_grads = first_grads or _experts_of(model, local=False)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, first_grads


def _shard(full, rank, ep=2):
    size = full.shape[0] // ep
    return full[rank * size : (rank + 1) * size]


def _assert_close(actual, expected, what):
    worst = (actual - expected).abs().max().item()
    assert worst < 1e-5, f"{what}: max |difference| = {worst}"


def test_each_rank_computes_what_one_process_computes_on_its_batch(two_ranks):
    """Logits and routing counts of each rank's batch; expert gradients of the mean of the two ranks' objectives."""
    model, objective = _model(), 0.0
    for rank in (0, 1):
        batch = _batch(rank)
        logits = model(batch[:, :-1])
        objective = objective + (_next_token_loss(logits, batch) + auxiliary_loss(model)) / 2
        step = two_ranks[rank]["step"]
        _assert_close(step["logits"], logits.detach(), f"rank {rank} logits")
        for layer, counts in zip(moe_layers(model), step["counts"], strict=True):
            assert torch.equal(counts, layer.last_tokens_per_expert), f"rank {rank} tokens per expert"
    objective.backward()
    expected = _experts_of(model, local=False)
    for rank in (0, 1):
        for name, grad in two_ranks[rank]["step"]["grads"].items():
            _assert_close(grad, _shard(expected[name], rank), f"rank {rank} gradient of {name}")


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_a_rank_that_receives_no_token_still_joins_and_gets_zero_expert_gradients(two_ranks, autocast):
    tolerance = 2e-2 if autocast else 1e-5  # bf16: rounding of the experts' matmuls, not of the routing
    ffn, objective = _skewed_ffn(), 0.0
    for rank in (0, 1):
        x = _skewed_input(rank)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ffn(x)
        objective = objective + out.float().square().mean() / 2
        got = two_ranks[rank]["empty"][autocast]
        assert (got["out"] - out.detach().float()).abs().max() < tolerance * out.abs().max()
        assert ffn.last_tokens_per_expert[2:].sum() == 0
    objective.backward()
    for rank in (0, 1):
        got = two_ranks[rank]["empty"][autocast]
        for name in EXPERT_WEIGHTS:
            expected = _shard(getattr(ffn, name).grad, rank)
            assert (got["grads"][name] - expected).abs().max() <= tolerance * expected.abs().max(), (
                f"rank {rank} {name}"
            )
            assert rank == 0 or not got["grads"][name].any()
    # each rank's input gradient is twice its own half of the objective's gradient: the skewed layer is rebuilt
    for rank in (0, 1):
        x = _skewed_input(rank)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _skewed_ffn()(x).float().square().mean().backward()
        got = two_ranks[rank]["empty"][autocast]["x_grad"]
        assert (got - x.grad).abs().max() <= tolerance * x.grad.abs().max(), f"rank {rank} input gradient"


def test_refuses_experts_that_do_not_split_and_a_second_application(two_ranks):
    assert two_ranks[0]["refusals"] == [
        "3 experts do not split evenly over ep = 2 ranks",
        "parallelize_experts was already applied to this model",
        "the model holds no MoEFeedForward layer",
    ]


def test_experts_are_dtensor_shards_holding_half_the_expert_weights(two_ranks):
    for rank in (0, 1):
        step = two_ranks[rank]["step"]
        assert step["all_dtensor"]
        assert 2 * step["local_count"] == step["full_count"]


def test_all_to_all_bytes_count_what_leaves_each_rank(two_ranks):
    """Per layer: dispatch and combine, forward and backward, each move the slots crossing ranks (d_model fp32 values
    each) once, plus the counts of the other rank's 2 experts (int64)."""
    counts = [two_ranks[rank]["step"]["counts"] for rank in (0, 1)]
    for rank in (0, 1):
        other = 1 - rank
        expected = 0
        for layer in range(CONFIG["n_layers"]):
            sent = _shard(counts[rank][layer], other).sum().item()
            received = _shard(counts[other][layer], rank).sum().item()
            expected += 2 * (sent + received) * CONFIG["d_model"] * 4 + 2 * 8
        assert two_ranks[rank]["step"]["bytes"] == expected
        assert two_ranks[rank]["step"]["bytes_after_reset"] == 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_training_with_fsdp_follows_one_process_on_the_concatenated_batches(two_ranks, four_ranks, world_size):
    runs = [two_ranks[rank]["train"] for rank in (0, 1)] if world_size == 2 else [four_ranks[r] for r in range(4)]
    losses, norms, grads = _single_process_training(world_size)
    mean = [sum(step) / world_size for step in zip(*(run["losses"] for run in runs), strict=True)]
    worst = max(abs(a - b) for a, b in zip(losses, mean, strict=True))
    assert worst < 1e-5, f"max |mean loss - single-process loss| = {worst}"
    assert losses[-1] < losses[0] and min(norms) > MAX_NORM
    for rank, run in enumerate(runs):
        worst = max(abs(a - b) for a, b in zip(norms, run["norms"], strict=True))
        assert worst < 1e-5, f"rank {rank}: max |gradient norm - single-process norm| = {worst}"
        for name, grad in run["first_grads"].items():
            _assert_close(grad, _shard(grads[name], rank % 2), f"rank {rank} first-step gradient of {name}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_checkpoint_of_the_ep_model_loads_into_one_full_model(two_ranks, four_ranks, checkpoint_dirs, world_size):
    """ep=2 on 2 ranks, and on 4 (two ranks save each expert shard: the checkpoint holds it once)."""
    runs = [two_ranks[rank]["train"] for rank in (0, 1)] if world_size == 2 else [four_ranks[r] for r in range(4)]
    trained = runs[0]["weights"]
    for run in runs[1:]:  # every rank's full view (its experts' replicas included) is the same
        assert all(torch.equal(run["weights"][name], tensor) for name, tensor in trained.items())
    assert set(trained) == set(_model().state_dict())
    state = _model().state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dirs[world_size])
    for name, tensor in state.items():
        assert torch.equal(tensor, trained[name]), name
    for name in ("layers.0.moe.w1", "layers.1.moe.w2"):
        assert not torch.equal(state[name], _model().state_dict()[name]), f"{name} was not trained"
