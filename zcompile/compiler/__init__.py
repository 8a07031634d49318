"""The compiler: the `zero` dynamo backend, its pass pipeline and the analyses passes and the planner use.
Compiling only rewrites graphs and records decisions; `backend._GraphCompile.commit_graph` is the one step that
turns them into runtime state."""
