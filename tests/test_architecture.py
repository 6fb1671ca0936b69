"""House rules import-linter cannot state (its contracts, in pyproject.toml, cover the layers)."""

from __future__ import annotations

import ast
import pathlib
import re

import ultraattn

_PKG = pathlib.Path(ultraattn.__file__).parent


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, ``from a import b`` giving ``a.b`` as well as ``a``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_the_planner_never_imports_torch_distributed():
    """The planner is pure: every rank runs it alone (the fast planner on the step's path), so it
    must not reach for a process group (import-linter forbids only top-level external packages)."""
    files = sorted((_PKG / "planner").rglob("*.py"))
    assert len(files) > 10
    bad = [f"{f.relative_to(_PKG)}:{line}: {mod}" for f in files for line, mod in _imports(f)
           if mod == "torch.distributed" or mod.startswith("torch.distributed.")]
    assert not bad, "\n".join(bad)


def test_the_scan_sees_every_form_of_the_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch.distributed as dist\nfrom torch import distributed\n"
                   "from torch.distributed import ProcessGroup\nfrom . import x\n")
    mods = [m for _, m in _imports(src)]
    assert "torch.distributed" in mods and "torch.distributed.ProcessGroup" in mods
    assert mods.count("torch.distributed") == 3  # once per line


def test_no_import_cycle_anywhere_in_the_package():
    """Every import, lazy ones inside functions included, flows one way: no module reaches itself again."""
    import grimp

    graph = grimp.build_graph("ultraattn", exclude_type_checking_imports=True)
    assert len(graph.modules) > 80
    cycles = sorted((a, b) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                    if graph.chain_exists(importer=b, imported=a))
    assert not cycles, "import cycles (module, a module it imports that leads back to it):\n" + "\n".join(
        f"{a} -> {b}" for a, b in cycles)


def test_every_ultraattn_op_has_one_row_in_the_op_table():
    """Op metadata lives in one table (``passes/opinfo.py``): every registered ``ultraattn::`` op has its row, and
    every row names a registered op."""
    import torch

    import ultraattn.compiler  # noqa: F401 - registers every op (passes and kernels)
    from ultraattn.passes.opinfo import OPS, ops_where

    registered = {n for n in dir(torch.ops.ultraattn)
                  if isinstance(getattr(torch.ops.ultraattn, n, None), torch._ops.OpOverloadPacket)}
    assert registered == set(OPS), (sorted(registered - set(OPS)), sorted(set(OPS) - registered))
    assert ops_where("wait") <= ops_where("comm") and ops_where("after") <= ops_where("comm")


def test_the_readme_stays_short_and_links_what_it_leaves_out():
    """README: at most 1,500 words (issue 55); the details it leaves out live in docs/ and are linked."""
    root = pathlib.Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    assert len(text.split()) <= 1500, len(text.split())
    for link in re.findall(r"\]\(((?:docs|examples)/[^)#]+)", text):
        assert (root / link).exists(), link


def test_one_function_decides_a_sites_form():
    """A site's ``SiteForm`` is decided in one place (``passes.forms.form_for``) and recorded in one
    (``passes/rewrite.py``): no other module assigns a ``form`` attribute, and no other module returns a form."""
    files = sorted(_PKG.rglob("*.py"))
    assigned, returned = set(), set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(leaf, ast.Attribute) and leaf.attr == "form":
                        assigned.add(str(f.relative_to(_PKG)))
            if isinstance(node, ast.Return) and node.value is not None:   # return SiteForm.X[, why]
                value = node.value.elts[0] if isinstance(node.value, ast.Tuple) and node.value.elts else node.value
                if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and \
                        value.value.id == "SiteForm":
                    returned.add(str(f.relative_to(_PKG)))
    assert assigned == {"passes/rewrite.py"}, assigned
    assert returned == {"passes/forms.py"}, returned


def _masks_imports(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """(line, masks module, name) of every name a file imports from ``ultraattn.masks``, relative imports
    included."""
    parts = path.relative_to(_PKG.parent).with_suffix("").parts
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            base = ".".join(parts[:len(parts) - node.level] + ((node.module,) if node.module else ()))
        if base == "ultraattn.masks" or base.startswith("ultraattn.masks."):
            out += [(node.lineno, base, a.name) for a in node.names]
    return out


def test_below_the_passes_a_mask_is_read_in_one_place():
    """A mask goes down to ``masks`` once on its way from a site op to a kernel (issue 54): ``masks.read.read_mask``
    reads it into its blocks and its element test, and the runtime and kernels use those. Neither imports a mask
    reader or evaluator of its own (``eval_mask``, ``to_block_pattern``, ``pattern_from_*``, ``cells_from_*``): from
    ``masks`` they take the kinds and types (``masks.pattern``, ``BlockCells``) and ``masks.read``; and
    ``plan_attention`` reads its mask once."""
    files = sorted([*(_PKG / "runtime").rglob("*.py"), *(_PKG / "kernels").rglob("*.py")])
    assert len(files) > 20
    allowed = {"ultraattn.masks.pattern", "ultraattn.masks.read"}
    bad = [f"{f.relative_to(_PKG)}:{line}: {mod}.{name}" for f in files for line, mod, name in _masks_imports(f)
           if mod not in allowed and (mod, name) != ("ultraattn.masks.cells", "BlockCells")]
    assert not bad, "\n".join(bad)
    # the scan sees relative imports: tiles.py takes its kinds that way
    assert ("ultraattn.masks.read", "ElementMask") in {(m, n) for _, m, n in _masks_imports(_PKG / "runtime/tiles.py")}
    api = ast.parse((_PKG / "runtime/api.py").read_text())
    reads = [n for n in ast.walk(api) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "read_mask"]
    assert len(reads) == 1, [n.lineno for n in reads]
