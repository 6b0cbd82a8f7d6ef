"""The house rules of the layout: one job per folder, imports only go down, no file circles.

Every `import` / `from ... import` of the project's own code (module level or inside functions) is
read with `ast`. Each folder has a level; a module imports only its own folder or lower levels.
Within a folder, no two files import each other, directly or around a circle. `importlib` may load
by name only what the registry names (engines, found by `plugins.engine.registry.BACKENDS`): a
string naming a project module above the caller's level is a reach past the layer rule. Each rule
is also run on a planted violation, so a checker that stopped seeing would fail here.
"""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("plugins", "injection", "converters", "scripts")

# folder (dotted) -> level; a module imports only its own folder or a lower level
LEVELS = {
    "plugins.core": 0,
    "plugins.kernels": 1,
    "plugins.engine": 2,
    "converters": 2,
    "injection": 3,
    "plugins.serving": 3,
    "plugins.launch": 4,
    "plugins.train": 4,
    "plugins.hf": 5,
    "plugins.deepspeed": 5,
    "plugins.megatron": 5,
    "plugins.peers": 5,
    "plugins.bench": 6,
    "plugins.http": 6,
    "plugins.fleet": 7,
    "plugins.triton": 7,
    "scripts": 8,
}
# Found by name at run time, never imported by the layers below them (plugins.engine.registry).
REGISTRY = ("plugins.engine.registry", "plugins.launch.worker")


def folder_of(module: str) -> str | None:
    best = None
    for folder in LEVELS:
        if module == folder or module.startswith(folder + "."):
            if best is None or len(folder) > len(best):
                best = folder
    return best


def project_modules(root: Path = REPO):
    for path in sorted(root.glob("**/*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] not in PACKAGES:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def imports_of(module: str, path: Path):
    """(line, imported module) for every import of a project module, relative imports resolved."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES:
                yield node.lineno, name


def upward_imports(root: Path = REPO) -> list[str]:
    found = []
    for module, path in project_modules(root):
        here = folder_of(module)
        if here is None:
            continue
        for line, name in imports_of(module, path):
            there = folder_of(name)
            if there is not None and there != here and LEVELS[there] >= LEVELS[here]:
                found.append(f"{path.relative_to(root)}:{line} ({here}) imports {name} ({there})")
    return found


def file_circles(root: Path = REPO) -> list[list[str]]:
    """Circles in the graph of file -> file imports (a package's __init__ counts as a file)."""
    modules = dict(project_modules(root))
    graph = {}
    for module, path in modules.items():
        targets = set()
        for _, name in imports_of(module, path):
            while name and name not in modules:  # `from a.b import f` names a.b, the file
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):  # a package's own __init__
                targets.add(name)
        graph[module] = targets
    circles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return circles


MODULE_STRING = re.compile(r"^((?:plugins|injection|converters)(?:\.\w+)+)(?::\w+)?$")


def importlib_reaches(root: Path = REPO) -> list[str]:
    """String constants naming a project module above the caller's level, in a file that uses
    importlib (`importlib.import_module(TABLE[...])`), outside the registry."""
    found = []
    for module, path in project_modules(root):
        here = folder_of(module)
        text = path.read_text()
        if here is None or module in REGISTRY or "importlib" not in text:
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                m = MODULE_STRING.match(node.value)
                there = folder_of(m.group(1)) if m else None
                if there is not None and there != here and LEVELS[there] >= LEVELS[here]:
                    found.append(f"{path.relative_to(root)}:{node.lineno} ({here}) loads {node.value!r} ({there})")
    return found


def test_every_module_has_a_folder():
    homeless = [m for m, _ in project_modules() if folder_of(m) is None and m not in ("plugins",)]
    assert not homeless, f"modules outside the layered folders: {homeless}"


def test_every_folder_of_the_tree_has_a_level():
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in REPO.glob("plugins/*/__init__.py")}
    assert folders <= set(LEVELS), f"folders without a level: {sorted(folders - set(LEVELS))}"


def test_imports_only_go_down():
    found = upward_imports()
    assert not found, "imports that do not go down:\n" + "\n".join(found)


def test_no_import_circle_between_files():
    found = file_circles()
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_importlib_loads_nothing_above_its_layer():
    found = importlib_reaches()
    assert not found, "importlib reaching up:\n" + "\n".join(found)


@pytest.mark.parametrize("folder", ["converters", "injection", "plugins.kernels", "plugins.core", "plugins.engine",
                                    "plugins.serving"])
def test_lower_folders_import_no_engine(folder):
    for module, path in project_modules():
        if folder_of(module) != folder:
            continue
        for line, name in imports_of(module, path):
            assert not name.startswith(("plugins.hf", "plugins.deepspeed", "plugins.megatron", "plugins.bench",
                                        "plugins.http.", "plugins.peers")), \
                f"{path.relative_to(REPO)}:{line} imports {name}"


# ---- the rules catch what they are for: a small tree with one planted violation each ----------

def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for rel in files:  # every folder on the way is a package
        for parent in (tmp_path / rel).parents:
            if parent == tmp_path:
                break
            (parent / "__init__.py").touch()
    return tmp_path


def test_a_planted_upward_import_is_found(tmp_path):
    root = plant(tmp_path, {"plugins/core/config.py": "from plugins.serving.batching import open_batch\n",
                            "plugins/serving/batching.py": "from plugins.core.config import ConfigError\n"})
    assert upward_imports(root) == ["plugins/core/config.py:1 (plugins.core) imports plugins.serving.batching "
                                    "(plugins.serving)", "plugins/core/config.py:1 (plugins.core) imports "
                                    "plugins.serving.batching.open_batch (plugins.serving)"]


def test_a_planted_file_circle_is_found(tmp_path):
    root = plant(tmp_path, {"plugins/core/a.py": "from plugins.core.b import x\n",
                            "plugins/core/b.py": "def f():\n    from .c import y\n",
                            "plugins/core/c.py": "import plugins.core.a\n"})
    assert file_circles(root) == [["plugins.core.a", "plugins.core.b", "plugins.core.c", "plugins.core.a"]]
    assert upward_imports(root) == []  # a circle within one folder breaks no level


def test_a_planted_importlib_reach_is_found(tmp_path):
    root = plant(tmp_path, {"plugins/core/make.py": 'import importlib\n\nTRAINER = "plugins.train"\n'
                                                    'importlib.import_module(TRAINER)\n'})
    assert importlib_reaches(root) == ["plugins/core/make.py:3 (plugins.core) loads 'plugins.train' (plugins.train)"]
    assert upward_imports(root) == []  # what the import rule alone would miss


# ---- tests/unit runs in the test process: what starts a process belongs in tests/integration ---

PROCESS_MODULES = ("subprocess", "multiprocessing", "live_server", "plugins.launch")
STARTERS = ("load_backend", "from_hf", "from_megatron", "RemoteBackend")  # tp_size > 1 or a launcher: ranks


def process_starts(path: Path) -> list[str]:
    """Imports of a module that starts processes, and engine loads that start ranks, in one test file
    (a load inside `with pytest.raises(...)` is refused before any rank starts: it is not counted)."""
    found, tree = [], ast.parse(path.read_text(), str(path))
    refused = {id(n) for w in ast.walk(tree) if isinstance(w, ast.With) and any(
        isinstance(i.context_expr, ast.Call) and getattr(i.context_expr.func, "attr", "") == "raises" for i in w.items)
        for stmt in w.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in refused:
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names
                      if any(n == m or n.startswith(m + ".") for m in PROCESS_MODULES)]
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in ("fork", "system", "posix_spawn") and getattr(node.func, "value", None) is not None \
                    and getattr(node.func.value, "id", "") == "os":
                found.append(f"{path.name}:{node.lineno} calls os.{func}")
            for kw in node.keywords if func in STARTERS else ():
                ranks = kw.arg == "tp_size" and not (isinstance(kw.value, ast.Constant) and kw.value.value == 1)
                if ranks or kw.arg == "launcher":
                    found.append(f"{path.name}:{node.lineno} {func}({kw.arg}=...) starts ranks")
    return found


def test_unit_tests_start_no_process():
    found = [hit for path in sorted((REPO / "tests" / "unit").glob("*.py")) for hit in process_starts(path)]
    assert not found, "process starts in tests/unit (move them to tests/integration):\n" + "\n".join(found)


def test_a_planted_process_start_is_found(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text("import subprocess\nfrom plugins.launch.launcher import RemoteBackend\n"
                    "b = load_backend('hf', d, tp_size=2)\nc = load_backend('hf', d, tp_size=1)\n"
                    "e = DeepSpeedBackend.from_hf(d, launcher='process')\n"
                    "with pytest.raises(ConfigError):\n    load_backend('hf', d, tp_size=3)\n")
    assert process_starts(path) == ["test_x.py:1 imports subprocess", "test_x.py:2 imports plugins.launch.launcher",
                                    "test_x.py:3 load_backend(tp_size=...) starts ranks",
                                    "test_x.py:5 from_hf(launcher=...) starts ranks"]
