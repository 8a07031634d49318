"""Where a dry compile (`zcompile plan`) spends its time, by depth: zcompile's passes, the partitioner, fake
propagation and liveness (the backend's per-phase timers), for the GPT-3 175B preset with fewer or more layers.

    python bench/plan_phases.py 24 96
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zcompile.tools import plan as zplan  # noqa: E402


def main() -> None:
    captured = []
    dry = zplan.zbackend.dry_backend

    def keep_jobs(cfg, ctx, jobs):
        captured.append(jobs)
        return dry(cfg, ctx, jobs)
    zplan.zbackend.dry_backend = keep_jobs
    for layers in [int(a) for a in sys.argv[1:]] or (24, 96):
        t0 = time.perf_counter()
        zplan.plan("gpt-175b", world=512, nodes=64, overrides={"n_layer": layers})
        (job,) = captured[-1]
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in job.times.items())
        print(f"{layers} layers: {time.perf_counter() - t0:.1f} s in all; {phases}", flush=True)


if __name__ == "__main__":
    main()
