"""Structure checks (single process, no compile): the package has no import cycles, and the pass contracts hold."""
import ast
import pathlib

import pytest

import zcompile
from zcompile import pass_contracts
from zcompile.pass_contracts import CONTRACTS, check_pipeline

ROOT = pathlib.Path(zcompile.__file__).parent


def _import_graph() -> dict[str, set[str]]:
    """module -> the zcompile modules it imports anywhere in its file (function-level imports included)."""
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for name, p in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = "done"
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_no_import_cycles():
    graph = _import_graph()
    assert "zcompile.compiler.passes.shard_params" in graph and "zcompile.config" in graph["zcompile.compiler.backend"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


# Layers, top to bottom: a module imports only modules of its own layer or lower ones.
LAYERS = [("tools", ("zcompile.tools",)), ("compiler", ("zcompile.compiler",)), ("runtime", ("zcompile.runtime",)),
          ("config", ("zcompile.config", "zcompile.pass_contracts")),
          ("leaves", ("zcompile.kernels", "zcompile.errors", "zcompile.models"))]


def _layer(module: str) -> int | None:
    for k, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return k
    return None  # the package itself and `python -m zcompile`: above every layer


def test_layers_depend_one_way():
    """tools -> compiler -> runtime -> config -> kernels/errors/models: the runtime never imports the compiler (the
    compiler's commit step builds runtime state), the config (read first, by every layer) imports neither, and
    every module of the package is in a layer."""
    graph = _import_graph()
    unplaced = [m for m in graph if _layer(m) is None and m not in ("zcompile", "zcompile.__main__")]
    assert not unplaced, unplaced
    bad = [f"{m} -> {d}" for m, deps in graph.items() if _layer(m) is not None
           for d in deps if _layer(d) is None or _layer(d) < _layer(m)]
    assert not bad, bad


# Inside the compiler, its stages top to bottom (zcompile/compiler/__init__.py): a stage imports only its own
# modules and those of the stages below it.
COMPILER_STAGES = [("wiring", ("zcompile.compiler.backend", "zcompile.compiler.job", "zcompile.compiler.memory_plan")),
                   ("codegen", ("zcompile.compiler.codegen",)), ("passes", ("zcompile.compiler.passes",)),
                   ("debug", ("zcompile.compiler.debug",)), ("planning", ("zcompile.compiler.planning",)),
                   ("tracing", ("zcompile.compiler.tracing",)), ("graph", ("zcompile.compiler.graph",))]


def _stage(module: str) -> int | None:
    for k, (_, prefixes) in enumerate(COMPILER_STAGES):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return k
    return None


def _stage_violations(graph: dict[str, set[str]]) -> tuple[list[str], list[str]]:
    """(compiler modules in no stage, imports that run up a stage) of an import graph."""
    compiler = [m for m in graph if m.startswith("zcompile.compiler.")]
    unplaced = [m for m in compiler if _stage(m) is None]
    up = [f"{m} -> {d}" for m in compiler if _stage(m) is not None
          for d in graph[m] if d.startswith("zcompile.compiler") and (_stage(d) is None or _stage(d) < _stage(m))]
    return unplaced, up


def test_compiler_stages_depend_one_way():
    """Every module of the compiler is in a stage folder (or the wiring), and none imports from a stage above its
    own: the graph vocabulary imports no stage, tracing no planning, planning no pass, and so on up."""
    unplaced, up = _stage_violations(_import_graph())
    assert not unplaced, unplaced
    assert not up, up


def test_stage_check_finds_an_import_up_a_stage():
    graph = {"zcompile.compiler.planning.liveness": {"zcompile.compiler.codegen.regions"},
             "zcompile.compiler.codegen.regions": {"zcompile.compiler.graph.blocks"},
             "zcompile.compiler.graph.blocks": set(), "zcompile.compiler.stray": set()}
    assert _stage_violations(graph) == (["zcompile.compiler.stray"],
                                        ["zcompile.compiler.planning.liveness -> zcompile.compiler.codegen.regions"])


def _long_classes(root: pathlib.Path, limit: int) -> list[str]:
    found = []
    for p in root.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit:
                found.append(f"{p.relative_to(root).as_posix()} {node.name} {node.end_lineno - node.lineno + 1}")
    return found


def test_the_compilers_wiring_and_classes_stay_small(tmp_path):
    """backend.py only wires the stages (at most 300 lines) and no class of the compiler carries more than one job
    (at most 200 lines): the plan's search, the budget, the commit each live in their stage."""
    compiler = ROOT / "compiler"
    assert len((compiler / "backend.py").read_text().splitlines()) <= 300
    assert not _long_classes(compiler, 200), _long_classes(compiler, 200)
    (tmp_path / "m.py").write_text("class Long:\n" + "    x = 1\n" * 200 + "\n\nclass Short:\n    y = 2\n")
    assert _long_classes(tmp_path, 200) == ["m.py Long 201"]  # the check sees a long class


_STATEFUL_CALLS = {"dict", "list", "set", "Counter", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "count",
                   "local", "Lock", "RLock"}


def _module_state() -> set[str]:
    """'runtime/groups.py _MADE' for every module-level name that holds state: an empty container, a counter, a
    lock or thread-local, or a name a function rebinds with `global`."""
    found = set()
    for p in ROOT.rglob("*.py"):
        tree = ast.parse(p.read_text())
        rebound = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = [t for t in node.targets if isinstance(t, ast.Name)], node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                targets, value = [node.target], node.value
            else:
                continue
            empty = isinstance(value, (ast.Dict, ast.List, ast.Set)) and not (
                getattr(value, "keys", None) or getattr(value, "elts", None))
            func = value.func if isinstance(value, ast.Call) else None
            call = func is not None and (getattr(func, "attr", None) or getattr(func, "id", None))
            for t in targets:
                if empty or call in _STATEFUL_CALLS or t.id in rebound:
                    found.add(f"{p.relative_to(ROOT).as_posix()} {t.id}")
    return found


def test_process_wide_state_is_documented():
    """Every module-level piece of state is in docs/architecture.md's table, and the table lists nothing else."""
    import re
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    documented = set()
    for row in re.findall(r"^\| `([\w/]+\.py)` ((?:`\w+`(?:, )?)+) \|", text, re.M):
        documented |= {f"{row[0]} {name}" for name in re.findall(r"`(\w+)`", row[1])}
    found = _module_state()
    assert "runtime/groups.py _MADE" in found and "compiler/backend.py _COMPILED" in found
    assert found == documented, (sorted(found - documented), sorted(documented - found))


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_config_reads_contracts_without_importing_passes():
    assert "zcompile.compiler.passes" not in _import_graph()["zcompile.config"]
    assert not {d for d in _import_graph()["zcompile.pass_contracts"]}  # a leaf: data only


def test_every_contract_has_a_pass():
    from zcompile.compiler.passes import PASSES
    assert PASSES.keys() == CONTRACTS.keys()


def test_default_pipeline_satisfies_every_stage():
    for stage in range(4):
        check_pipeline(pass_contracts.DEFAULT_PIPELINE, stage)


def test_a_reader_listed_before_the_writer_is_refused():
    names = ("tag_param_recompute", "shard_params", "reduce_grads", "quantize_gradients", "bucket_collectives")
    with pytest.raises(ValueError, match="quantize_gradients.*members.*bucket_collectives"):
        check_pipeline(names, 3)


def test_undeclared_record_field_is_caught():
    """A pass that sets a record field its contract does not declare fails right after it runs."""
    import torch
    import torch.fx as fx
    from zcompile.compiler.graph import collectives
    from zcompile.compiler.passes import check_records
    g = fx.Graph()
    x = g.placeholder("x")
    w = collectives.all_gather(g, x, 4, torch.float32, 2, "0", "gather x")
    g.output(w)
    gm = fx.GraphModule(torch.nn.Module(), g)
    check_records(gm, frozenset(), "none")
    collectives.update(w.args[0], members=[2, 2])
    with pytest.raises(AssertionError, match="members"):
        check_records(gm, pass_contracts.written_fields(["shard_params"]), "shard_params")
    check_records(gm, pass_contracts.written_fields(["bucket_collectives"]), "bucket_collectives")


def test_every_pass_has_a_unit_test_calling_it():
    """tests/test_passes.py, or the pass's own tests/test_<pass>.py, runs each pass by name (`<pass>.run(`) on a
    small graph."""
    from zcompile.compiler.passes import PASSES
    tests = ROOT.parent / "tests"
    text = (tests / "test_passes.py").read_text()
    missing = [name for name in PASSES if f"{name}.run(" not in text
               and f"{name}.run(" not in ((tests / f"test_{name}.py").read_text()
                                          if (tests / f"test_{name}.py").exists() else "")]
    assert not missing, missing
