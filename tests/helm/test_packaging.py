"""How users install trainguard: packages and container images.

``pip install trainguard`` (CLI, plugin, controller, agent) must pull no torch, even
indirectly; ``trainguard[train]`` asks for a torch *range* that contains the version CI tests
(the Makefile's pin), never a pin that would replace a training image's CUDA build. Each
component has its own non-root image, built as a target of the Dockerfile and named the way
the chart expects it.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MAKEFILE = (ROOT / "Makefile").read_text()
TRAINING_ONLY = {"torch", "safetensors"}


def _requirements(extra: str | None = None) -> list[Requirement]:
    project = PYPROJECT["project"]
    specs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [Requirement(spec) for spec in specs]


def _closure(roots: list[Requirement]) -> set[str]:
    """Every distribution ``roots`` pull in, walked through the installed metadata."""
    env = {**default_environment(), "extra": ""}
    seen: set[str] = set()
    todo = [r for r in roots if r.marker is None or r.marker.evaluate(env)]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here: its own requirements cannot be walked
        for spec in requires:
            sub = Requirement(spec)
            extras_env = [{**env, "extra": e} for e in req.extras] or [env]
            if sub.marker is None or any(sub.marker.evaluate(e) for e in extras_env):
                todo.append(sub)
    return seen


def test_base_install_pulls_no_torch() -> None:
    direct = {canonicalize_name(r.name) for r in _requirements()}
    assert not direct & TRAINING_ONLY
    pulled = _closure(_requirements())
    assert "fastapi" in pulled and "kubernetes" in pulled  # the walk does reach deep
    assert not pulled & {"torch", "triton", "nvidia-cudnn-cu12", "safetensors"}


def _torch(extra: str) -> Requirement:
    (torch,) = [r for r in _requirements(extra) if canonicalize_name(r.name) == "torch"]
    return torch


def test_train_extra_asks_for_a_torch_range_that_holds_the_tested_version() -> None:
    torch = _torch("train")
    operators = {spec.operator for spec in torch.specifier}
    assert "==" not in operators and "===" not in operators and "~=" not in operators
    assert any(op in (">=", ">") for op in operators), "no lower bound"
    assert any(op in ("<", "<=") for op in operators), "no upper bound"
    pin = re.search(r"^TORCH_PIN := torch==(\S+)$", MAKEFILE, re.MULTILINE)
    assert pin, "the Makefile pins the CPU wheel it installs for local use"
    assert torch.specifier.contains(Version(pin.group(1)))
    installed = Version(metadata.version("torch").split("+")[0])
    assert torch.specifier.contains(installed), f"the tested torch {installed} is out of range"


def test_makefile_installs_the_pinned_wheel_before_the_extras() -> None:
    recipe = MAKEFILE.split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    pin_line = recipe.index('"$(TORCH_PIN)"')
    extras_line = recipe.index('-e ".[train,dev]"')
    assert pin_line < extras_line  # else pip would resolve torch from the range first


def _stages(dockerfile: str) -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined)."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in dockerfile.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if match:
            current = stages.setdefault(match.group(2) or f"<{len(stages)}>", [])
            current.append(f"FROM {match.group(1)}")
        else:
            current.append(line)
    return stages


def _effective(stages: dict[str, list[str]], name: str, instruction: str) -> str | None:
    """The last ``instruction`` in stage ``name`` or the stages it is built FROM."""
    found = None
    for line in stages[name]:
        if line.startswith("FROM ") and line[5:] in stages:
            found = _effective(stages, line[5:], instruction) or found
        elif line.upper().startswith(instruction + " "):
            found = line.split(None, 1)[1]
    return found


def test_one_non_root_image_per_component_named_as_the_chart_expects() -> None:
    stages = _stages((ROOT / "Dockerfile").read_text())
    values = yaml.safe_load((ROOT / "helm" / "trainguard" / "values.yaml").read_text())
    for component in ("controller", "agent"):
        assert component in stages, f"Dockerfile has no target {component!r}"
        user = _effective(stages, component, "USER")
        assert user is not None and user.split(":")[0] not in ("0", "root")
        label = _effective(stages, component, "LABEL") or ""
        title = re.search(r'org\.opencontainers\.image\.title="([^"]+)"', label)
        assert title, f"target {component} has no image title"
        assert values[component]["image"]["repository"] == title.group(1)
        entrypoint = _effective(stages, component, "ENTRYPOINT")
        assert entrypoint == f'["trainguard", "{component}"]'
    assert values["image"]["registry"] == ""  # bare names: the registry is the user's choice
