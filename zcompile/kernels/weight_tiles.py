"""`zcompile::weight_tiles`: a [out, in] weight cut into tiles of whole rows, in the layout tile_linears gathers.

The weight is padded to world*R rows (R rows per rank, R a multiple of `tiles`) and viewed as
[world, tiles, R/tiles, in]; tile t is [:, t] flattened to [world*R/tiles, in]: rows r*R + t*R/tiles + j of every
rank r. That is exactly what an all-gather of slice t of every rank's row-aligned shard returns, so shard_params
replaces each tile by such a gather and the op itself never runs in a sharded graph. Its gradient is
`zcompile::weight_tiles_grad`, which stacks the tile gradients back into the weight's layout; reduce_grads instead
reduce-scatters each tile gradient on its own as soon as it exists (slice t of every rank's shard gradient).
"""
from __future__ import annotations

import torch


def _tiles(w: torch.Tensor, tiles: int, world: int, rows_per_rank: int) -> list[torch.Tensor]:
    out_f, in_f = w.shape
    padded = torch.nn.functional.pad(w, (0, 0, 0, world * rows_per_rank - out_f))
    view = padded.view(world, tiles, rows_per_rank // tiles, in_f)
    return [view[:, t].reshape(-1, in_f) for t in range(tiles)]


@torch.library.custom_op("zcompile::weight_tiles", mutates_args=())
def weight_tiles(w: torch.Tensor, tiles: int, world: int, rows_per_rank: int) -> list[torch.Tensor]:
    return [t.clone() for t in _tiles(w, tiles, world, rows_per_rank)]


@weight_tiles.register_fake
def _(w, tiles, world, rows_per_rank):
    return [w.new_empty(world * rows_per_rank // tiles, w.shape[1]) for _ in range(tiles)]


@torch.library.custom_op("zcompile::weight_tiles_grad", mutates_args=())
def weight_tiles_grad(grads: list[torch.Tensor], world: int, out_features: int) -> torch.Tensor:
    rows, in_f = grads[0].shape
    stacked = torch.stack([g.reshape(world, rows // world, in_f) for g in grads], dim=1)  # [world, T, R/T, in]
    return stacked.reshape(-1, in_f)[:out_features].clone()


@weight_tiles_grad.register_fake
def _(grads, world, out_features):
    return grads[0].new_empty(out_features, grads[0].shape[1])


def _setup(ctx, inputs, output):
    w, tiles, world, rows_per_rank = inputs
    ctx.world, ctx.out_features = world, w.shape[0]


def _backward(ctx, grads):
    ref = next(g for g in grads if g is not None)
    grads = [g if g is not None else ref.new_zeros(ref.shape) for g in grads]
    return torch.ops.zcompile.weight_tiles_grad(list(grads), ctx.world, ctx.out_features), None, None, None


weight_tiles.register_autograd(_backward, setup_context=_setup)
