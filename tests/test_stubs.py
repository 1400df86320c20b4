"""The installed package ships typed stubs for its C++ core: ``_fast.pyi`` (from nanobind's stubgen at build
time, see CMakeLists.txt) and the PEP 561 ``py.typed`` marker."""

from __future__ import annotations

import ast
from pathlib import Path

import mlx_infer
from mlx_infer import _fast

PACKAGE = Path(mlx_infer.__file__).parent


def _stub() -> ast.Module:
    path = PACKAGE / "_fast.pyi"
    assert path.is_file(), f"{path} is missing: the build did not run tools/stubgen.py (see its warning)"
    return ast.parse(path.read_text(encoding="utf-8"))


def test_the_package_is_marked_typed() -> None:
    assert (PACKAGE / "py.typed").is_file()


def test_the_stub_declares_every_public_name_of_the_module() -> None:
    declared = {n.name for n in _stub().body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    declared |= {t.id for n in _stub().body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    declared |= {n.target.id for n in _stub().body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    public = {name for name in dir(_fast) if not name.startswith("_")}
    assert public - declared == set(), "names of _fast missing from _fast.pyi"
    assert {"PageGroups", "PagedDecodeStep", "slot_mapping", "built_mlx_version"} <= declared


def test_the_stub_carries_argument_names_and_array_types() -> None:
    fn = next(n for n in _stub().body if isinstance(n, ast.FunctionDef) and n.name == "slot_mapping")
    names = [a.arg for a in fn.args.args] + [a.arg for a in fn.args.kwonlyargs]
    assert names == ["block_tables", "positions", "page_size"]
    assert ast.unparse(fn.returns) == "mlx.core.array"
