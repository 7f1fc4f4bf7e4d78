"""jet.config and jet.configlib: every error names the offending path; overrides; round trips."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from jet import config, configlib
from jet.config import JetConfig, load, load_file
from jet.configlib import Section
from jet.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
DEFAULT = config.default_config_path()
SECTIONS = (JetConfig, config.QueueConfig, config.ModelConfig, config.AdapterConfig, config.TaskConfig, config.RuntimeConfig,
            config.TrainerConfig)


def minimal(**extra) -> dict:
    """The smallest useful config: one model, one task."""
    data = {
        "models": [{"name": "m", "path": "models/m"}],
        "tasks": [{"name": "t", "workflow": "pkg.mod:run", "dataset": "guess"}],
    }
    data.update(extra)
    return data


def error(fn, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return info.value


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- the default config


def test_default_config_ships_in_the_package_and_loads_with_its_paths_resolved(tmp_path, monkeypatch):
    assert DEFAULT == REPO / "jet" / "configs" / "default.yaml" and DEFAULT.is_file()
    # A packaged config's relative paths resolve against the folder jet runs in, never the package's.
    monkeypatch.chdir(tmp_path)
    cfg = load_file(DEFAULT)
    assert cfg.run == "demo"
    assert [m.name for m in cfg.models] == ["tiny"]
    assert cfg.models[0].backend == "hf"
    assert cfg.models[0].path == str(tmp_path / ".jet" / "models" / "tiny")
    (task,) = cfg.tasks
    assert (task.name, task.workflow, task.dataset, task.group_size, task.model) == (
        "guess", "jet.tasks.guess:workflow", "guess", 4, "tiny")
    assert cfg.trainer.steps < config.TrainerConfig().steps
    assert cfg.run_dir == Path("runs") / "demo"


def test_defaults_are_valid_and_every_field_has_a_description():
    cfg = load({})
    assert cfg == JetConfig()
    assert cfg.trainer.lr == 1e-5 and cfg.queues.max_entry_bytes == 16 * 1024 * 1024
    for cls in SECTIONS:
        assert cls.model_fields, cls
        for name, f in cls.model_fields.items():
            # the docstring under the field: what it does, ending with its unit or choices
            assert f.description and len(f.description) > 20 and f.description.endswith((".", ")")), (cls, name)


def test_sections_are_frozen_and_strict():
    cfg = load({"trainer": {"lr": 0.5}})
    with pytest.raises(Exception):
        cfg.trainer.lr = 1.0
    assert cfg.trainer.lr == 0.5
    assert str(error(load, {"trainer": {"steps": "3"}})) == "trainer.steps: expected int, got '3'"
    assert str(error(load, {"models": [{"name": "m", "path": "p", "trainable": 1}]})) == (
        "models[0].trainable: expected bool, got 1")
    # model_copy(update=...) is how code derives a changed config (no validation: for trusted values)
    assert cfg.model_copy(update={"run": "x"}).run == "x" and cfg.run == "default"


# ---- unknown keys, types, required keys


def test_unknown_key_suggests_the_closest_field():
    err = error(load, {"trainer": {"lrr": 1e-4}})
    assert str(err) == "trainer.lrr: unknown key (did you mean 'lr'?)"
    assert err.key == "trainer.lrr"
    assert str(error(load, {"zzz": 1})) == "zzz: unknown key"


def test_wrong_type_names_path_and_value():
    assert str(error(load, {"trainer": {"lr": "fast"}})) == "trainer.lr: expected float, got 'fast'"
    assert str(error(load, {"trainer": {"lr": True}})) == "trainer.lr: expected float, got True"
    assert str(error(load, {"trainer": {"steps": True}})) == "trainer.steps: expected int, got True"
    assert str(error(load, {"trainer": {"steps": 1.5}})) == "trainer.steps: expected int, got 1.5"
    assert str(error(load, {"run": 7})) == "run: expected str, got 7"
    assert str(error(load, {"trainer": [1]})) == "trainer: expected a mapping, got [1]"


def test_int_is_accepted_for_float_and_stored_as_float():
    cfg = load({"trainer": {"lr": 1, "kl_coef": 0}})
    assert cfg.trainer.lr == 1.0 and type(cfg.trainer.lr) is float
    assert cfg.trainer.kl_coef == 0.0 and type(cfg.trainer.kl_coef) is float


def test_missing_required_key_in_a_list_item():
    data = minimal()
    del data["tasks"][0]["workflow"]
    assert str(error(load, data)) == "tasks[0].workflow: missing required key"


def test_literal_lists_the_choices():
    data = minimal()
    data["models"].append({"name": "b", "path": "p", "backend": "tgi"})
    assert str(error(load, data)) == "models[1].backend: expected one of 'hf', 'vllm', got 'tgi'"
    # True == 1 in Python, but not in a config.
    assert str(error(load, {"trainer": {"zero_stage": True}})).startswith("trainer.zero_stage: expected one of 0, 1, 2, 3")


def test_lists_and_dicts_and_optionals():
    assert str(error(load, {"tasks": {"name": "t"}})) == "tasks: expected a list, got {'name': 't'}"
    data = minimal()
    data["tasks"][0]["name"] = "a:b"
    assert str(error(load, data)).startswith("tasks[0].name: task name 'a:b' must match")
    data = minimal()
    data["tasks"][0]["reward"] = 5
    assert str(error(load, data)) == "tasks[0].reward: expected str, got 5"
    data["tasks"][0]["reward"] = None
    assert load(data).tasks[0].reward is None
    data["tasks"][0]["runtime"] = {"python": 3}
    assert str(error(load, data)) == "tasks[0].runtime.python: expected str, got 3"
    assert str(error(load, {"queues": {"maxlen": {"gen": "x"}}})) == "queues.maxlen.gen: expected int, got 'x'"
    assert str(error(load, {"queues": {"maxlen": ["gen"]}})) == "queues.maxlen: expected a mapping, got ['gen']"


def test_maxlen_keeps_defaults_for_kinds_not_given_and_rejects_unknown_kinds():
    cfg = load({"queues": {"maxlen": {"gen": 5, "dead": 7}}})
    assert cfg.queues.maxlen == {"tasks": 100_000, "gen": 5, "traj": 10_000, "dead": 7}
    err = error(load, {"queues": {"maxlen": {"taks": 5}}})
    assert str(err) == "queues.maxlen.taks: unknown stream kind (did you mean 'tasks'?)"
    assert str(error(load, {"queues": {"maxlen": {"gen": 0}}})) == "queues.maxlen.gen: must be > 0, got 0"


def test_empty_section_takes_defaults():
    assert load({"trainer": None}).trainer == config.TrainerConfig()


# ---- ranges and cross checks (raised in __post_init__, path added by load)


def test_range_checks_name_the_path():
    assert str(error(load, {"trainer": {"lr": 0}})) == "trainer.lr: must be > 0, got 0.0"
    assert str(error(load, {"trainer": {"warmup_steps": -1}})) == "trainer.warmup_steps: must be >= 0, got -1"
    assert str(error(load, {"queues": {"block_ms": 40000}})) == (
        "queues.block_ms: must be below lease_ms (30000), got 40000")
    data = minimal()
    data["tasks"].append({"name": "u", "workflow": "a:b", "dataset": "d", "concurrency": 0})
    assert str(error(load, data)) == "tasks[1].concurrency: must be > 0, got 0"
    data["tasks"][1].update(concurrency=1, group_size=1)
    assert str(error(load, data)) == "tasks[1].group_size: 1 is below trainer.min_group_size (2)"
    data["tasks"][1]["group_size"] = 2
    assert load(data).tasks[1].group_size == 2
    # A section built from keywords (`Section.of`) raises the same error, relative to the section.
    assert str(error(config.TrainerConfig.of, lr=-1.0)) == "lr: must be > 0, got -1.0"


def test_workflow_and_reward_must_be_module_function():
    for bad in ("nocolon", "a:b:c", "a.:b", ":f", "a b:c"):
        data = minimal()
        data["tasks"][0]["workflow"] = bad
        assert str(error(load, data)).startswith("tasks[0].workflow: expected 'module:function'"), bad
    data = minimal()
    data["tasks"][0]["reward"] = "rewards"
    assert str(error(load, data)).startswith("tasks[0].reward: expected 'module:function'")
    data["tasks"][0].update(workflow="a.b_c:Cls.run", reward="r:f")
    assert load(data).tasks[0].reward == "r:f"


def test_names_unique_and_tasks_name_a_configured_model():
    data = minimal()
    data["models"].append({"name": "m", "path": "other"})
    assert str(error(load, data)) == "models[1].name: duplicate name 'm' (also models[0])"
    data = minimal()
    data["tasks"].append(dict(data["tasks"][0]))
    assert str(error(load, data)) == "tasks[1].name: duplicate name 't' (also tasks[0])"
    data = minimal()
    data["tasks"][0]["model"] = "nope"
    assert str(error(load, data)) == "tasks[0].model: unknown model 'nope'; configured: 'm'"
    assert str(error(load, {"run": "a{b}"})).startswith("run: run name 'a{b}' must match")


def test_task_model_defaults_to_the_only_model():
    assert load(minimal()).tasks[0].model == "m"
    data = minimal()
    data["models"].append({"name": "judge", "path": "j", "trainable": False})
    assert str(error(load, data)) == (
        "tasks[0].model: required unless exactly one model is configured (2 are)")
    data["tasks"][0]["model"] = "judge"
    assert load(data).task("t").model == "judge"


def test_secrets_are_refused_anywhere():
    err = error(load, {"redis_url": "redis://localhost"})
    assert err.key == "redis_url" and "JET_REDIS_URL" in str(err)
    err = error(load, {"queues": {"password": "hunter2"}})
    assert err.key == "queues.password" and "environment" in str(err)
    assert error(load, {"queues": {"maxlen": {"password": 1}}}).key == "queues.maxlen.password"


def test_redis_url_comes_from_cli_then_environment(monkeypatch):
    monkeypatch.delenv(config.REDIS_URL_ENV, raising=False)
    assert config.redis_url() is None
    monkeypatch.setenv(config.REDIS_URL_ENV, "redis://env:6379")
    assert config.redis_url() == "redis://env:6379"
    assert config.redis_url("redis://cli:6379") == "redis://cli:6379"


# ---- files


def test_missing_file(tmp_path):
    err = error(load_file, tmp_path / "nope.yaml")
    assert str(err) == f"{tmp_path / 'nope.yaml'}: no such config file"


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "run: demo\ntrainer:\n  lr: [1e-5\n  steps: 3\n")
    err = error(load_file, path)
    assert str(err).startswith(f"{path}:") and "invalid YAML" in str(err)
    assert re.match(rf"{re.escape(str(path))}:[34]:\d+: ", str(err)), str(err)


def test_duplicate_yaml_key_is_an_error(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: 0.1\n  lr: 0.2\n")
    assert str(error(load_file, path)) == f"{path}:3:3: invalid YAML: duplicate key 'lr'"


def test_file_errors_name_the_file_and_the_path(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: fast\n")
    err = error(load_file, path)
    assert str(err) == f"{path}: trainer.lr: expected float, got 'fast'"
    assert (err.file, err.key) == (str(path), "trainer.lr")
    assert "expected a mapping at the top level" in str(error(load_file, write(tmp_path, "- 1\n", "l.yaml")))


def test_exponent_floats_without_a_dot_are_floats(tmp_path):
    # PyYAML alone reads `1e-5` as the string '1e-5' (YAML 1.1).
    assert load_file(write(tmp_path, "trainer:\n  lr: 3e-5\n")).trainer.lr == 3e-5


def test_empty_file_is_all_defaults(tmp_path):
    assert load_file(write(tmp_path, "# nothing\n")) == JetConfig()


def test_relative_paths_resolve_against_the_config_folder(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # never against the folder jet runs in
    path = write(tmp_path / "conf", yaml.safe_dump(minimal(models=[{"name": "m", "path": "./models/m"}], tasks=[{
        "name": "t", "workflow": "a:b", "dataset": "data/rows.jsonl",
        "runtime": {"python": "../venv/bin/python", "cwd": "work"}}])))
    cfg = load_file(path)
    assert cfg.models[0].path == str(tmp_path / "conf" / "models" / "m")
    assert cfg.tasks[0].dataset == str(tmp_path / "conf" / "data" / "rows.jsonl")
    assert cfg.tasks[0].runtime.python == str(tmp_path / "venv" / "bin" / "python")
    assert cfg.tasks[0].runtime.cwd == str(tmp_path / "conf" / "work")
    # Only with check_paths must they exist.
    err = error(load_file, path, check_paths=True)
    assert err.key == "models[0].path"
    assert str(err).startswith(f"{path}: models[0].path: no model directory at '{tmp_path / 'conf' / 'models' / 'm'}'")
    (tmp_path / "conf" / "models" / "m").mkdir(parents=True)
    assert "it has no config.json" in str(error(load_file, path, check_paths=True))
    (tmp_path / "conf" / "models" / "m" / "config.json").write_text("{}")
    assert error(load_file, path, check_paths=True).key == "tasks[0].dataset"


def test_check_paths_passes_when_everything_exists(tmp_path):
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    cfg = load_file(write(tmp_path, yaml.safe_dump(minimal())), check_paths=True)
    assert cfg.tasks[0].dataset == "guess"  # a built-in name is not a path


# ---- overrides


def test_overrides_set_nested_list_and_dict_values():
    cfg = load_file(DEFAULT, ["trainer.lr=1e-5", "tasks.0.weight=2", "tasks[0].merge=tree",
                              "queues.maxlen.gen=5", "run=exp-2", "tasks.0.reward=r:f"])
    assert cfg.trainer.lr == 1e-5
    assert cfg.tasks[0].weight == 2.0 and cfg.tasks[0].merge == "tree"
    assert cfg.queues.maxlen["gen"] == 5 and cfg.run == "exp-2"
    assert cfg.tasks[0].reward == "r:f"


def test_override_creates_sections_missing_from_the_file(tmp_path):
    path = write(tmp_path, yaml.safe_dump(minimal()))
    cfg = load_file(path, ["trainer.steps=3", "tasks.0.runtime.cwd=/tmp"])
    assert cfg.trainer.steps == 3 and cfg.tasks[0].runtime.cwd == "/tmp"


def test_override_type_errors_name_the_path():
    err = error(load_file, DEFAULT, ["trainer.lr=fast"])
    assert err.key == "trainer.lr" and str(err).endswith("trainer.lr: expected float, got 'fast'")
    err = error(load_file, DEFAULT, ["tasks.0.group_size=many"])
    assert str(err).endswith("tasks[0].group_size: expected int, got 'many'")
    err = error(load_file, DEFAULT, ["models.0.backend=tgi"])
    assert str(err).endswith("models[0].backend: expected one of 'hf', 'vllm', got 'tgi'")


def test_override_key_errors_name_the_path():
    assert str(error(load_file, DEFAULT, ["trainer.lrr=1"])).endswith(
        "trainer.lrr: unknown key (did you mean 'lr'?)")
    assert str(error(load_file, DEFAULT, ["tasks.3.weight=2"])).endswith(
        "tasks[3]: index out of range: tasks has 1 item(s)")
    assert str(error(load_file, DEFAULT, ["tasks.weight=2"])).endswith(
        "tasks.weight: tasks is a list: use an index, e.g. tasks.0.weight")
    assert str(error(load_file, DEFAULT, ["trainer.lr.x=2"])).endswith(
        "trainer.lr.x: trainer.lr is float, not a section")
    assert error(load_file, DEFAULT, ["queues.redis_url=redis://x"]).key == "queues.redis_url"
    assert "expected KEY=VALUE" in str(error(load_file, DEFAULT, ["trainer.lr"]))
    assert "not valid YAML" in str(error(load_file, DEFAULT, ["trainer.lr=[1"]))


def test_overrides_apply_in_order():
    assert load_file(DEFAULT, ["trainer.steps=3", "trainer.steps=4"]).trainer.steps == 4


# ---- dump, round trip, resolved file


def test_dump_load_round_trip():
    cfg = load_file(DEFAULT, ["tasks.0.reward=r:f", "queues.maxlen.dead=9"])
    data = config.dump(cfg)
    assert data["trainer"]["lr"] == cfg.trainer.lr and data["tasks"][0]["runtime"] == {"python": None, "cwd": None}
    assert load(data) == cfg
    assert load(yaml.safe_load(yaml.safe_dump(data))) == cfg


def test_write_resolved_round_trips_through_load_file(tmp_path):
    cfg = load_file(DEFAULT, ["trainer.steps=7"])
    path = config.write_resolved(cfg, tmp_path / "runs" / "demo")
    assert path == tmp_path / "runs" / "demo" / "config.resolved.yaml"
    assert load_file(path) == cfg
    assert not list(path.parent.glob("*.tmp"))


# ---- the generic machinery on its own


class Inner(Section):
    x: int = 0
    """An int."""


class Outer(Section):
    pair: tuple[str, int] = ("a", 1)
    """A fixed-length tuple."""
    many: tuple[float, ...] = ()
    """A variable-length tuple."""
    inner: Inner | None = None
    """An optional section."""
    table: dict[str, list[Inner]] = {}
    """Nested containers."""
    either: int | str = 0
    """A union."""


def test_configlib_tuples_optionals_unions_and_nested_containers():
    obj = configlib.validate(Outer, {"pair": ["b", 2], "many": [1, 2.5], "inner": {"x": 3},
                                     "table": {"k": [{"x": 1}]}, "either": "s"})
    assert obj == Outer(pair=("b", 2), many=(1.0, 2.5), inner=Inner(x=3), table={"k": [Inner(x=1)]}, either="s")
    assert configlib.validate(Outer, configlib.dump(obj)) == obj
    assert configlib.dump(obj)["pair"] == ["b", 2]
    assert str(error(configlib.validate, Outer, {"pair": ["b"]})) == "pair: expected a list of 2 items, got 1"
    assert str(error(configlib.validate, Outer, {"pair": ["b", 1, 2]})) == "pair: expected a list of 2 items, got 3"
    assert str(error(configlib.validate, Outer, {"pair": ["b", "c"]})) == "pair[1]: expected int, got 'c'"
    assert str(error(configlib.validate, Outer, {"many": [1, "x"]})) == "many[1]: expected float, got 'x'"
    assert str(error(configlib.validate, Outer, {"table": {"k": [{"y": 1}]}})) == "table.k[0].y: unknown key"
    assert str(error(configlib.validate, Outer, {"inner": {"x": "1"}})) == "inner.x: expected int, got '1'"
    assert str(error(configlib.validate, Outer, {"either": 1.5})) == "either: expected int or str, got 1.5"
    assert configlib.validate(Outer, {"inner": None}).inner is None
    assert str(error(configlib.validate, Outer, {"pair": 5}, "top")) == "top.pair: expected a list, got 5"
    assert str(error(configlib.validate, Outer, {"table": {1: []}})) == "table.1: keys must be strings, got 1"


def test_trainer_fields_of_the_trainer_issue():
    cfg = load({"trainer": {"lr_schedule": "cosine", "nproc": 2, "lease_s": 60, "weight_decay": 0.01}})
    assert (cfg.trainer.lr_schedule, cfg.trainer.nproc, cfg.trainer.lease_s) == ("cosine", 2, 60.0)
    assert str(error(load, {"trainer": {"nproc": 0}})) == "trainer.nproc: must be > 0, got 0"
    assert str(error(load, {"trainer": {"lr_schedule": "step"}})).startswith("trainer.lr_schedule: expected one of")
    assert str(error(load, {"trainer": {"device": ""}})) == "trainer.device: must not be empty"


# ---- multi-model teams and task cocktails (docs/swarm.md)


def test_a_models_trainer_section_overrides_the_top_level_one():
    data = minimal(trainer={"lr": 1e-3, "steps": 10})
    data["models"] = [{"name": "a", "path": "a", "trainer": {"lr": 5e-4, "seed": 7}}, {"name": "b", "path": "b"}]
    data["tasks"][0]["model"] = "a"
    cfg = load(data)
    assert (cfg.trainer_of("a").lr, cfg.trainer_of("a").seed, cfg.trainer_of("a").steps) == (5e-4, 7, 10)
    assert cfg.trainer_of("b") == cfg.trainer and cfg.trainer.lr == 1e-3
    assert load(config.dump(cfg)) == cfg
    with pytest.raises(KeyError):
        cfg.trainer_of("c")


def test_a_models_trainer_override_is_validated_with_its_path():
    def bad(override):
        data = minimal()
        data["models"][0]["trainer"] = override
        return str(error(load, data))

    assert bad({"lrr": 1.0}).endswith("models[0].trainer.lrr: unknown trainer setting (did you mean 'lr'?)")
    assert bad({"lr": "fast"}).endswith("models[0].trainer.lr: expected float, got 'fast'")
    assert bad({"steps": 0}).endswith("models[0].trainer.steps: must be > 0, got 0")
    assert bad({"advantage": "ppo"}).startswith("models[0].trainer.advantage: expected one of")


def test_a_models_trainer_override_can_be_set_from_the_cli(tmp_path):
    path = write(tmp_path, yaml.safe_dump(minimal()))
    cfg = load_file(path, ["models.0.trainer.lr=0.5", "trainer.mix_wait_s=2"])
    assert cfg.trainer_of("m").lr == 0.5 and cfg.trainer.lr == 1e-5 and cfg.trainer_of("m").mix_wait_s == 2.0
    assert str(error(load_file, path, ["trainer.mix_wait_s=-1"])).endswith("trainer.mix_wait_s: must be >= 0, got -1.0")


def test_team_and_cocktail_configs_load():
    team = load_file(REPO / "configs" / "team.yaml")
    assert [(m.name, m.trainable) for m in team.models] == [("proposer", True), ("solver", True)]
    assert team.trainer_of("proposer").seed != team.trainer_of("solver").seed
    assert team.tasks[0].workflow == "jet.tasks.propose:workflow" and team.tasks[0].dataset == "propose"
    lora = load_file(REPO / "configs" / "team-lora.yaml")
    assert [m.name for m in lora.models] == [m.name for m in team.models] and lora.tasks == team.tasks
    assert lora.serving_groups() == [["proposer", "solver"]], "one inference worker for the team"
    assert all(m.adapter is not None and m.path == lora.models[0].path for m in lora.models)
    cocktail = load_file(REPO / "configs" / "cocktail.yaml")
    assert {t.name: t.weight for t in cocktail.tasks} == {"guess": 3.0, "arith": 1.0}
    assert cocktail.trainer.mix_wait_s > 0
