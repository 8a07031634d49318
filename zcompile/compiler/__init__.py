"""The compiler: the `zero` dynamo backend, its pass pipeline and the analyses the passes and the planner use.

Stages, top to bottom; a folder imports only from those below it (tests/test_architecture.py checks the order):

    backend.py, job.py,   dynamo's graph -> the function dynamo runs: the stages below wired per graph
    memory_plan.py        (job.GraphCompile), with the memory planner's trials (memory_plan.MemoryPlan)
    codegen/              final graphs and decisions -> compiled code (eager, inductor, regions), runtime state
                          (commit.py), the compile cache
    passes/               a graph and its pass context -> the graph rewritten: one pass per file, from the config
    debug/                graphs and schedules -> dumps, timelines, the ranks' schedule agreement, quiet AOT logs
    planning/             partitioned graphs -> liveness, peaks (FX plan, inductor's code), the activation plan and
                          its search, the budget check
    tracing/              the user's frame, dynamo's graph, the joint graph -> sharded modules, blocks traced once,
                          inductor's joint passes, the min-cut partition
    graph/                what every stage reads: collective records, meta keys, blocks, topology, pass context,
                          fake values, graph copies

Compiling only rewrites graphs and records decisions; codegen/commit.py's `commit_graph` is the one step that turns
them into runtime state."""
