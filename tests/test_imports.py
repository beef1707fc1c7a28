"""The packages' import graph: no cycle among modules (imports inside functions count), and the layering
minituner -> {minigpt, miniquant} -> minikernels: minigpt and miniquant import nothing above them, nor each other,
and minikernels (the C build helper both use) imports nothing of ours."""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("minikernels", "minigpt", "miniquant", "minituner")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((SRC / pkg).rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Our modules that `name` imports, at any depth of its code (top level or inside a function)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (c := visit(n)):
            return c
    return None


def is_package_init(name: str) -> bool:
    return (SRC / name.replace(".", "/") / "__init__.py").is_file()


def test_no_import_cycle():
    # a package's __init__ re-exporting its submodules is not a cycle: leave those edges out
    g = {n: {m for m in deps if not (is_package_init(n) and m.startswith(n + "."))} for n, deps in graph().items()}
    assert find_cycle(g) is None, " -> ".join(find_cycle(g))


def test_layering():
    for name, deps in graph().items():
        top = name.split(".")[0]
        allowed = {"minikernels": {"minikernels"}, "minigpt": {"minigpt", "minikernels"},
                   "miniquant": {"miniquant", "minikernels"}, "minituner": set(PACKAGES)}[top]
        assert {d.split(".")[0] for d in deps} <= allowed, f"{name} imports {sorted(deps)}"


def test_the_checker_sees_a_cycle_and_function_level_imports():
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    g = graph()
    assert "minituner.peft_format" in g["minituner.adapter_io"]  # a top-level relative import is seen
    assert "minigpt.base_folder" in g["minituner.base_model"]
