"""The allowed import directions (README, "Architecture"), checked on every import statement of the
package, including imports inside functions:

  base < math < services and channel data < actors < controller and channel loops < cli

A module may import modules of its own layer or below, never above. The transport layer
(`meshrl.channels`) knows no roles at all: it imports only configuration and types."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "meshrl"

LAYERS = {  # module prefix -> layer (the longest matching prefix decides)
    "meshrl.types": 0, "meshrl.config": 0, "meshrl.logprobs": 0,
    "meshrl.losses": 1, "meshrl.advantages": 1, "meshrl.renderers": 1,
    "meshrl.training": 2, "meshrl.envs": 2, "meshrl.engines": 2, "meshrl.teachers": 2, "meshrl.channels": 2,
    "meshrl.models": 2, "meshrl.meshes": 2, "meshrl.sdpo": 2, "meshrl.replay": 2, "meshrl.diloco": 2,
    "meshrl.actors": 3, "meshrl.testing": 3,
    "meshrl.controller": 4, "meshrl.sdpo.channel": 4, "meshrl.replay.channel": 4, "meshrl.testing.fake_meshes": 4,
    "meshrl.cli": 5, "meshrl.teachers.serve": 5, "meshrl.launch": 5, "meshrl.api": 5, "meshrl.serve": 5,
    "meshrl.testing.fake_api": 5, "meshrl.diloco.executors": 5, "meshrl.report": 5,
}
TRANSPORT_MAY_IMPORT = ("meshrl.channels", "meshrl.config", "meshrl.types")


def layer(module: str) -> int:
    matches = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    assert matches, f"{module} has no layer: add it to LAYERS"
    return LAYERS[max(matches, key=len)]


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
           if m.startswith("meshrl.channels") and not t.startswith(TRANSPORT_MAY_IMPORT)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_imports_inside_functions():
    found = {(m, t) for m, t, _ in imports()}
    # the runtime imports its actors inside __init__; those count
    assert ("meshrl.controller.runtime", "meshrl.actors.learner") in found
