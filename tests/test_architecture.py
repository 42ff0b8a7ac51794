"""The allowed import directions (docs/architecture.md), checked on every import statement of the
package, including imports inside functions:

  base < math < services and channel data < actors < controller and channel loops < cli

A module may import modules of its own layer or below, never above. The transport layer
(`meshrl.transport`) knows no roles at all: it imports only configuration and types."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "meshrl"

LAYERS = {  # package (a folder, or a module of its own) -> layer
    "meshrl.types": 0, "meshrl.jsonl": 0, "meshrl.config": 0, "meshrl.logprobs": 0, "meshrl.plugins": 0,
    "meshrl.losses": 1, "meshrl.advantages": 1, "meshrl.renderers": 1,
    "meshrl.training": 2, "meshrl.envs": 2, "meshrl.engines": 2, "meshrl.teachers": 2, "meshrl.transport": 2,
    "meshrl.models": 2, "meshrl.judges": 2, "meshrl.sdpo": 2, "meshrl.replay": 2, "meshrl.diloco": 2, "meshrl.metrics": 2,
    "meshrl.agents": 2,
    "meshrl.actors": 3,
    "meshrl.meshes": 4,
    "meshrl.terms": 5,
    "meshrl.controller": 6,
    "meshrl.cli": 7, "meshrl.launch": 7, "meshrl.api": 7, "meshrl.serve": 7, "meshrl.report": 7, "meshrl.testing": 7,
}
TRANSPORT_MAY_IMPORT = ("meshrl.transport", "meshrl.config", "meshrl.types")


def layer(module: str) -> int:
    package = ".".join(module.split(".")[:2])
    assert package in LAYERS, f"{module} has no layer: add {package} to LAYERS"
    return LAYERS[package]


def imports() -> list[tuple[str, str, int]]:
    """(importing module, imported meshrl module, line) for every import in the package."""
    out = []
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshrl"):
                targets = [node.module] if node.module != "meshrl" else [f"meshrl.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("meshrl")]
            else:
                continue
            out += [(module, t, node.lineno) for t in targets]
    return out


def test_imports_only_go_down_the_layers():
    upward = [f"{m}:{line} imports {t}" for m, t, line in imports()
              if m != "meshrl" and layer(t) > layer(m)]
    assert not upward, "\n".join(upward)


def test_transport_knows_no_roles():
    bad = [f"{m}:{line} imports {t}" for m, t, line in imports()
           if m.startswith("meshrl.transport") and not t.startswith(TRANSPORT_MAY_IMPORT)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_imports_inside_functions():
    found = {(m, t) for m, t, _ in imports()}
    # the mesh session imports the actors it spawns inside its methods; those count
    assert ("meshrl.meshes.session", "meshrl.actors.learner") in found


def test_every_package_has_a_layer():
    packages = {".".join(m.split(".")[:2]) for m, _, _ in imports() if m != "meshrl"}
    assert not packages - set(LAYERS), sorted(packages - set(LAYERS))


def test_the_front_ends_and_channel_folders_do_not_import_the_controller():
    below = ("meshrl.sdpo", "meshrl.replay", "meshrl.api", "meshrl.serve", "meshrl.meshes", "meshrl.actors",
             "meshrl.diloco", "meshrl.terms")
    bad = [f"{m}:{line} imports {t}" for m, t, line in imports()
           if m.startswith(below) and (t.startswith("meshrl.controller") or
                                       (m.startswith("meshrl.diloco") and t.startswith("meshrl.launch")))]
    assert not bad, "\n".join(bad)
