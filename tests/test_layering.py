"""The layout's promise: `launch` is parts stacked one way, and the trainers stand on the bottom ones.

The allowed direction, stated once: a module may import its own part and the parts *below* it in
LAYERS, never one above nor one beside it on the same level. The trainers (`jaxrun`,
`torchrun_fsdp`) may import only TRAINER_PARTS and never each other. The graph counts lazy imports
inside functions too, since they run as surely as top-level ones.
"""

import ast

from conftest import ROOT

# bottom first; parts that share a level (report, interop) may not import each other
LAYERS = (("common",), ("config",), ("data",), ("core",), ("interop", "report"), ("targets",), ("launcher",))
LEVEL = {part: i for i, parts in enumerate(LAYERS) for part in parts}
TRAINER_PARTS = {"common", "config", "data", "core"}
TRAINERS = ("jaxrun", "torchrun_fsdp")
TOP_LEVEL = {"launch", "launch.__main__"}  # the package's map and `python -m launch`


def modules(package):
    for p in sorted((ROOT / package).rglob("*.py")):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        yield (name[: -len(".__init__")] if name.endswith(".__init__") else name), p


def imports(path, known):
    """Project modules a file imports, at the top or inside functions (lazy imports count)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known}
    return out


def project_graph():
    mods = {}
    for pkg in ("launch", *TRAINERS):
        mods.update(modules(pkg))
    return {m: imports(p, mods) - {m} for m, p in mods.items()}


def part(module):
    """`launch.core.loop` -> 'core'; a trainer module -> its package; `launch` itself -> None."""
    bits = module.split(".")
    if bits[0] != "launch":
        return bits[0]
    return bits[1] if len(bits) > 1 and bits[1] in LEVEL else None


def violations(edges):
    """Every import that goes up or sideways, as 'a -> b (why)'."""
    bad = []
    for src, targets in sorted(edges.items()):
        p = part(src)
        for dst in sorted(targets):
            q = part(dst)
            if src in TOP_LEVEL or q is None:
                continue
            if p in TRAINERS:
                if q in TRAINERS and q != p:
                    bad.append(f"{src} -> {dst} (a trainer imports the other trainer)")
                elif q not in TRAINERS and q not in TRAINER_PARTS:
                    bad.append(f"{src} -> {dst} (a trainer imports launch.{q}; it may import only "
                               f"{', '.join(sorted(TRAINER_PARTS))})")
            elif q in TRAINERS:
                bad.append(f"{src} -> {dst} (launch imports a trainer)")
            elif q != p and LEVEL[q] >= LEVEL[p]:
                way = "beside it" if LEVEL[q] == LEVEL[p] else "above it"
                bad.append(f"{src} -> {dst} (launch.{p} imports launch.{q}, which is {way})")
    return bad


def cycles(edges):
    found = []
    for start in edges:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    found.append(path + [start])
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def test_every_launch_module_belongs_to_a_part():
    loose = [m for m, _ in modules("launch") if m not in TOP_LEVEL and part(m) is None]
    assert not loose, f"modules at launch/ top level that belong in a part: {loose}"
    assert {p.name for p in (ROOT / "launch").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LEVEL)


def test_imports_go_down_only():
    bad = violations(project_graph())
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    """Protects against an orchestrator below its workers (targets importing the sweep, jobs <-> slurm)."""
    found = cycles(project_graph())
    assert not found, " ; ".join(" -> ".join(c) for c in found[:5])


def test_the_rule_catches_what_it_names():
    """The checker itself: a core module importing the launcher, a trainer importing the report, data
    importing core, report importing interop, and a target importing the orchestrator are each refused."""
    edges = project_graph()
    for src, dst in (("launch.core.loop", "launch.launcher.rundir"), ("jaxrun.train", "launch.report.report"),
                     ("launch.data.batches", "launch.core.params"), ("launch.report.report", "launch.interop.export"),
                     ("launch.targets.local", "launch.launcher.sweep"), ("torchrun_fsdp.train", "jaxrun.model"),
                     ("launch.config.loader", "launch.data.tokenizer")):
        assert src in edges and dst in edges, (src, dst)
        mutated = {**edges, src: edges[src] | {dst}}
        assert any(v.startswith(f"{src} -> {dst} ") for v in violations(mutated)), (src, dst)
    assert cycles({"a": {"b"}, "b": {"a"}}) and not cycles({"a": {"b"}, "b": set()})
