"""What every compiler stage reads and writes on an FX graph: collective records (`collectives`), meta keys, the
block a node belongs to, the topology, the pass context, fake values, and copies of graphs to transform. Imports
nothing else of the compiler."""
