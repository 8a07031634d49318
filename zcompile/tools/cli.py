"""The `zcompile` command: `zcompile plan MODEL --world N [--nodes K] ...` (see zcompile.tools.plan)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: zcompile plan MODEL --world N [--nodes K] [--config zero3.yaml] [--out DIR]\n\n"
              "  plan   compile MODEL for N ranks on the meta device; print per-rank memory, traffic and schedule")
        return 0 if argv else 2
    if argv[0] == "plan":
        from zcompile.tools.plan import main as plan_main
        return plan_main(argv[1:])
    print(f"zcompile: unknown command {argv[0]!r} (available: plan)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
