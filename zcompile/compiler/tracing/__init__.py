"""From the user's frame to a forward and a backward graph: before dynamo traces (`before_trace`, `warmup`), the
graph dynamo hands over (`dynamo_graph`: modules sharded, dynamo restarted), repeated blocks traced once and kept as
regions through AOTAutograd (`trace_blocks_once`, `block_regions`), and the joint graph's partition (`partition`)."""
