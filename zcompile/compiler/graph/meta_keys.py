"""FX meta keys the passes and analyses set on graph nodes and read back (here, below every module that reads them,
so the regions' cut can read what liveness marks without importing it)."""

RELEASED = "zc_released"  # placeholder meta: a saved activation the graph frees after its last use
PARAMETER = "zc_parameter"  # placeholder meta: a parameter's shard or whole buffer (resident between steps)
INDUCTOR = "zc_inductor"  # graph meta: compiled by inductor, its value whether in regions (compiled_by_inductor)
BLOCK = "zc_block"  # node meta in a region module: the block (blocks.block_of) of the node it was copied from
