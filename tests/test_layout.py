"""The tree's architecture (docs/architecture.md): which part may import which, the public face
`import jaxrl_scale` gives, and links between the docs. Reads source files; compiles nothing."""

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PKG = ROOT / "jaxrl_scale"

# The parts from the ground up: a module may import its own part and parts of lower rank only.
# Parts of equal rank never import each other. Top-level modules are parts of their own.
RANK = {
    "configbase": 0,
    "fit": 1,
    "parallel": 1,
    "models": 2,
    "tasks": 3,
    "generation": 3,
    "serve": 4,
    "rl": 5,
    "hosts": 6,
    "memory": 6,
    "config": 7,
    "train": 8,
    "sweep": 9,
    "demo": 9,
    "serving": 9,
    "cli": 10,
}
PUBLIC = [
    "load_config",
    "train",
    "load_pretrained",
    "generate",
    "policy_loss",
    "group_advantages",
    "get_task",
    "fit",
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    return module.split(".")[1]


def _runtime_imports(path: Path) -> set[str]:
    """Every jaxrl_scale module `path` imports when it runs (function bodies included, blocks
    under `if TYPE_CHECKING` not), as dotted names of modules or packages."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("jaxrl_scale.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxrl_scale"):
            for alias in node.names:  # `from jaxrl_scale.models import lora` names a module
                sub = f"{node.module}.{alias.name}"
                is_module = (ROOT / sub.replace(".", "/")).with_suffix(".py").exists()
                found.add(sub if is_module else node.module)
    return {m for m in found if m != "jaxrl_scale"}  # the package root is the lazy public face


def _modules():
    return sorted(p for p in PKG.rglob("*.py") if p != PKG / "__init__.py")


def test_every_module_belongs_to_a_known_part():
    unknown = {_part(_module_name(p)) for p in _modules()} - set(RANK)
    assert not unknown, f"parts missing from docs/architecture.md's order: {sorted(unknown)}"


def test_no_part_imports_a_higher_part_or_a_part_beside_it():
    wrong = []
    for path in _modules():
        module = _module_name(path)
        here = _part(module)
        for target in _runtime_imports(path):
            there = _part(target)
            if there != here and RANK[there] >= RANK[here]:
                wrong.append(f"{module} imports {target} ({here} {RANK[here]} -> {there} "
                             f"{RANK[there]})")  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_the_import_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: a lower part importing the root config is caught, a type-only
    import is not."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from jaxrl_scale.config import ExperimentConfig\n"
        "def f():\n    from jaxrl_scale.train import train\n"
        "from jaxrl_scale.models import lora, policy\n"
    )
    assert _runtime_imports(bad) == {
        "jaxrl_scale.train",
        "jaxrl_scale.models.lora",
        "jaxrl_scale.models.policy",
    }


def test_modules_inside_a_part_import_each_other_in_one_direction():
    """No two modules import each other (function-level imports included)."""
    graph = {_module_name(p): _runtime_imports(p) for p in _modules()}
    cycles = sorted(
        f"{a} <-> {b}" for a, targets in graph.items() for b in targets if a in graph.get(b, ())
        if a < b
    )  # fmt: skip
    assert not cycles, cycles


def test_import_jaxrl_scale_is_cheap_and_gives_the_public_face():
    code = (
        "import sys, jaxrl_scale as jr; "
        "print(sorted(m for m in ('jax', 'flax', 'numpy', 'jaxopt') if m in sys.modules)); "
        "print(sorted(n for n in jr.__all__ if n != '__version__'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    loaded, names = done.stdout.strip().splitlines()
    assert loaded == "[]", f"import jaxrl_scale loaded {loaded}"
    assert names == str(sorted(PUBLIC))


def test_public_names_are_the_parts_functions():
    import jaxrl_scale as jr
    from jaxrl_scale import fit
    from jaxrl_scale.config import load_config
    from jaxrl_scale.generation.sampler import generate
    from jaxrl_scale.models.hf import load_pretrained
    from jaxrl_scale.rl.advantages import group_advantages
    from jaxrl_scale.rl.losses import policy_loss
    from jaxrl_scale.tasks import get_task
    from jaxrl_scale.train import train

    assert jr.load_config is load_config
    assert jr.load_pretrained is load_pretrained
    assert jr.generate is generate
    assert jr.policy_loss is policy_loss
    assert jr.group_advantages is group_advantages
    assert jr.get_task is get_task
    assert jr.fit is fit and callable(jr.fit.fit_sigmoid) and callable(jr.fit.bootstrap_sigmoid)
    assert callable(jr.train) and inspect.signature(jr.train) == inspect.signature(train)
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        _ = jr.nonesuch


def test_docs_api_documents_every_public_name():
    api = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in PUBLIC if f"`{n}" not in api and f"jr.{n}" not in api]
    assert not missing, f"docs/api.md does not document {missing}"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_anchor_rule_matches_github():
    heading = "Mixture of experts (`model.architecture: qwen3_moe`, `jaxrl_scale/models/moe.py`)"
    assert (
        _anchor(heading) == "mixture-of-experts-modelarchitecture-qwen3_moe-jaxrl_scalemodelsmoepy"
    )


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "launch" / "README.md"]
    pages += sorted((ROOT / "docs").glob("*.md"))
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(\s*([^)\s]+)\s*\)", text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
