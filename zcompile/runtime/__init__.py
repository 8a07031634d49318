"""The runtime: sharded parameter state, DTensor parameters, offload tiers, process groups, checkpoints, and what
runs around the optimizer step."""
