"""The house rules of the layout: one job per folder, imports only go down.

Every `import` / `from ... import` statement of the project's own code (module level or inside
functions) is read with `ast`; each folder has a level, and a module may import only its own
folder or folders of a lower level. Backends are found by name (`plugins.core.backend.BACKENDS`),
never imported by the layers below them.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# folder (dotted) -> level; a module imports only its own folder or a lower level
LEVELS = {
    "plugins.core": 0,
    "plugins.kernels": 1,
    "converters": 2,
    "injection": 2,
    "plugins.hf": 3,
    "plugins.train": 3,
    "plugins.deepspeed": 4,
    "plugins.megatron": 4,
    "plugins.peers": 4,
    "plugins.bench": 5,
    "plugins.serve": 5,
    "scripts": 6,
}
PACKAGES = ("plugins", "injection", "converters", "scripts")


def folder_of(module: str) -> str | None:
    best = None
    for folder in LEVELS:
        if module == folder or module.startswith(folder + "."):
            if best is None or len(folder) > len(best):
                best = folder
    return best


def project_modules():
    for path in sorted(REPO.glob("**/*.py")):
        rel = path.relative_to(REPO)
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


def test_every_module_has_a_folder():
    homeless = [m for m, _ in project_modules() if folder_of(m) is None and m not in ("plugins",)]
    assert not homeless, f"modules outside the layered folders: {homeless}"


def test_imports_only_go_down():
    back_edges = []
    for module, path in project_modules():
        here = folder_of(module)
        if here is None:
            continue
        for line, name in imports_of(module, path):
            there = folder_of(name)
            if there is None or there == here:
                continue
            if LEVELS[there] >= LEVELS[here]:
                back_edges.append(f"{path.relative_to(REPO)}:{line} ({here}) imports {name} ({there})")
    assert not back_edges, "imports that do not go down:\n" + "\n".join(back_edges)


@pytest.mark.parametrize("folder", ["converters", "injection", "plugins.kernels", "plugins.core"])
def test_lower_folders_import_no_engine(folder):
    """Converters are pure state-dict code: no model instance, no launcher, no engine."""
    for module, path in project_modules():
        if folder_of(module) != folder:
            continue
        for line, name in imports_of(module, path):
            assert not name.startswith(("plugins.hf", "plugins.deepspeed", "plugins.megatron", "plugins.bench",
                                        "plugins.serve")), f"{path.relative_to(REPO)}:{line} imports {name}"
