"""How a layout is stated to users: the run summary's ``layout`` and the dry run's mesh line."""

from __future__ import annotations

from omegaconf import DictConfig

from distrain.parallelism.capabilities import capabilities_of
from distrain.parallelism.layout import Layout


def degree_items(mesh: Layout) -> dict[str, int]:
    """Every degree by its config name, in the order the mesh line prints them (ep last: it splits dp)."""
    return {"dp_replicate": mesh.replicate, "dp": mesh.dp, "cp": mesh.cp, "tp": mesh.tp, "pp": mesh.pp, "ep": mesh.ep}


def mesh_line(mesh: Layout) -> str:
    """The dry run's line: the axes whose product is the world size, then ep, a split of dp."""
    axes = {axis: size for axis, size in degree_items(mesh).items() if axis != "ep"}
    ranks = mesh.replicate * mesh.dp * mesh.cp * mesh.tp * mesh.pp
    product = " x ".join(f"{axis} {size}" for axis, size in axes.items())
    return f"mesh: {product} = {ranks} ranks; ep {mesh.ep} (of the dp ranks, splitting the experts)"


def describe_degrees(mesh: Layout) -> str:
    """The degrees above 1 whose product is the world size, e.g. ``dp_replicate 2 x dp 2``, then ``ep`` (a split
    of dp, not a factor of the world size): ``dp 4; ep 2 of dp``."""
    axes = [f"{axis} {size}" for axis, size in degree_items(mesh).items() if axis != "ep" and size > 1]
    return " x ".join(axes or ["dp 1"]) + (f"; ep {mesh.ep} of dp" if mesh.ep > 1 else "")


def layout_description(parallelism: DictConfig, layout: Layout) -> str:
    """The layout as the run summary states it: ``ddp``, ``zero stage 2``, ``hsdp (dp_replicate 2 x dp 2, fsdp
    stage 3)``, ``hybrid (dp 2 x tp 2, dp replicated)``: the option's name, with the degrees of a mesh layout."""
    capabilities = capabilities_of(parallelism)
    if capabilities.zero_stages:
        return f"{parallelism.name} stage {layout.sharding_stage}"
    if not capabilities.device_mesh:  # ddp, single: every rank holds the model
        return parallelism.name
    holding = ""
    if layout.dp_holds == "replicate":
        holding = ", dp replicated"
    elif layout.data_parallel * layout.cp > 1:  # FSDP shards over dp x cp (as the strategy wraps it)
        holding = f", fsdp stage {layout.sharding_stage}"
    return f"{parallelism.name} ({describe_degrees(layout)}{holding})"
