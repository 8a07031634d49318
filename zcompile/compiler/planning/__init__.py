"""What a graph costs and what fits: liveness and peaks from the FX order (`liveness`, `inductor_buffers`,
`region_cuts`) or from inductor's code (`wrapper_memory`), the step's peak and cost model (`planner`, `timeline`),
the activation plan and its search (`recompute`, `activation_plan`, `activation_search`), and the budget's checks
(`budget`). Takes graphs; gives numbers and decisions, and rewrites only where a plan says so."""
