"""The shape of the code that users and later components rely on: every config field documented,
components chosen by registered names, and imports that run one way (the core knows no
environment; rollout/ and envs/ do not import each other; nothing below the trainer imports it)."""

import ast
import graphlib
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from agentrl.config import ConfigError, TrainConfig, load_config
from agentrl.registry import BACKENDS, ENGINES, Registry

ROOT = Path(__file__).resolve().parents[1]


def sections(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from sections(field.annotation, f"{prefix}{name}.")


def test_every_config_field_has_a_description():
    fields = dict(sections(TrainConfig))
    assert len(fields) > 70
    missing = [key for key, field in fields.items() if not (field.description or "").strip()]
    assert not missing, f"config fields without a description (write a docstring under each): {missing}"


@pytest.mark.parametrize(
    "override,message",
    [
        ("engine.kind=sglang_x", "unknown engine.kind 'sglang_x'"),
        ("engine.kind=locall", "Did you mean 'local'? Registered: local"),
        (
            "trainer.backend=torhc",
            "unknown trainer.backend 'torhc'. Did you mean 'torch'? Registered: megatron, torch",
        ),
    ],
)
def test_unknown_component_names_the_closest_registered_one(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(TrainConfig, None, [override])


def test_a_registered_component_is_built_by_name():
    registry = Registry("engine.kind", {})
    registry.register("mine", "tests.test_structure:make_component")
    assert registry.names() == ["mine"] and registry.factory("mine")(1, None) == ("built", 1)
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        registry.register("bad", "no_colon")
    assert ENGINES.names() == ["local", "sglang"] and BACKENDS.names() == ["megatron", "torch"]


def make_component(policy, cfg):
    return "built", policy


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` of the file names, at any depth (imports inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def offenders(files, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in files:
        bad = sorted(m for m in imported_modules(path) if m.startswith(forbidden))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


CORE = sorted((ROOT / "agentrl").glob("*.py"))
CORE = [p for p in CORE if p.name != "cli.py"]  # the command line sits above everything


def test_the_core_knows_no_environment_and_nothing_above_it():
    assert offenders(CORE, ("agentrl.envs", "envs", "agentrl.rollout", "agentrl.trainer")) == {}


def test_rollout_and_envs_do_not_import_each_other():
    rollout = sorted((ROOT / "agentrl/rollout").rglob("*.py"))
    assert offenders(rollout, ("agentrl.envs", "envs", "agentrl.trainer")) == {}
    envs = sorted((ROOT / "envs").rglob("*.py"))
    assert envs and offenders(envs, ("agentrl.rollout", "agentrl.trainer", "agentrl.cli")) == {}


def package_modules() -> dict[str, Path]:
    """Every module of the installed package, by name (envs/ and sandboxes/ install as agentrl.envs
    and agentrl.sandboxes); a package by its ``__init__.py``."""
    found = {}
    for top, name in (("agentrl", "agentrl"), ("envs", "agentrl.envs"), ("sandboxes", "agentrl.sandboxes")):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT / top).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((name, *parts))] = path
    return found


def test_no_modules_import_each_other_in_a_loop():
    """A loop of imports (deferred ones inside functions too) means two files that cannot be read, or
    changed, one without the other: what they share belongs in one of them or below both."""
    modules = package_modules()
    graph = {name: imported_modules(path) & modules.keys() - {name} for name, path in modules.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"modules that import each other in a loop: {' -> '.join(e.args[1])}")


def test_algorithms_are_pure():
    algo = sorted((ROOT / "agentrl/algo").rglob("*.py"))
    allowed = ("agentrl.algo",)
    bad = {
        str(p.relative_to(ROOT)): sorted(
            m for m in imported_modules(p) if m.startswith("agentrl") and not m.startswith(allowed)
        )
        for p in algo
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_shipped_backend_and_engine_implement_their_protocols():
    from agentrl.models import tiny_chat_model
    from agentrl.rollout.engine import Engine
    from agentrl.rollout.local import from_config as engine_from_config
    from agentrl.trainer.backend import TrainBackend
    from agentrl.trainer.torch_backend import from_config as backend_from_config

    cfg = TrainConfig()
    policy, _ = tiny_chat_model(hidden=16, layers=1)
    assert isinstance(backend_from_config(policy, cfg), TrainBackend)
    assert isinstance(engine_from_config(policy, cfg), Engine)
    from agentrl.rollout.sglang import SGLangEngine

    assert isinstance(SGLangEngine("http://127.0.0.1:30000"), Engine)
    for protocol in (TrainBackend, Engine):  # each member the protocol declares, its docstring explains
        members = [m for m in vars(protocol) if not m.startswith("_")] + list(protocol.__annotations__)
        assert members and all(f"``{m}``" in protocol.__doc__ for m in members), protocol


def test_the_config_reference_is_up_to_date():
    from agentrl.config import reference

    written = (ROOT / "docs/config.md").read_text()
    assert written == reference(), "docs/config.md is out of date: run `make docs`"
    leaves = [
        key
        for key, field in sections(TrainConfig)
        if "." in key and not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel))
    ]
    assert all(f"`{key}`" in written for key in leaves)


def test_the_megatron_recipe_and_its_80_gb_variant_fit_the_model_and_node_its_header_names():
    """swe_ppo_megatron.yaml's parallel sizes, as given and with the ``trainer.megatron.*`` overrides
    its header gives for 80 GB cards, fill the 8 GPUs of the training node and split
    Qwen2.5-Coder-7B-Instruct (its config.json: 28 heads, 4 key/value heads, MLP 18944, 28 layers)
    the way the Megatron backend checks at start."""
    from transformers import Qwen2Config

    from agentrl.trainer.megatron_convert import check_config

    recipe = ROOT / "recipes/swe_ppo_megatron.yaml"
    header = "".join(line for line in recipe.read_text().splitlines() if line.startswith("#"))
    variant = re.findall(r"trainer\.megatron\.\w+=\d+", header)
    assert variant, "the header no longer gives the 80 GB variant's sizes"
    qwen = Qwen2Config(
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        num_hidden_layers=28,
    )
    for overrides in ([], variant):
        sizes = load_config(TrainConfig, str(recipe), overrides).trainer.megatron
        assert sizes.tp * sizes.pp * sizes.dp == 8, (overrides, sizes)
        check_config(qwen, sizes.tp)
        assert qwen.num_hidden_layers % sizes.pp == 0, (overrides, sizes)
