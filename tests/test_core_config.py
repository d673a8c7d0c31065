"""Configs: validation errors name the key, defaults fill in, get_config round-trips."""
import pytest
import yaml

import deepreduce
from deepreduce import ConfigError, DeepReduceError, registry

BASE = {"sparsifier": {"id": "topk", "ratio": 0.01}, "index": {"id": "raw"}, "value": {"id": "raw"},
        "memory": {"id": "residual"}}


def with_section(section, value):
    return dict(BASE, **{section: value})


def test_yaml_path_and_dict_give_equal_pipelines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert deepreduce.build(str(path)) == deepreduce.build(BASE)


def test_load_config_fills_defaults():
    cfg = deepreduce.load_config({"sparsifier": {"id": "topk"}, "index": "raw", "value": "raw", "memory": "none"})
    assert cfg["sparsifier"] == {"id": "topk", "ratio": 0.01}
    assert cfg["min_numel"] == 1000 and cfg["nonfinite"] == "propagate" and cfg["warmup"] == 0


def test_warmup_is_in_the_wire_digest_only_when_set():
    """Ranks must agree on a warm-up (it changes the containers of the first steps); a config
    without one keeps the digest, hence the containers, it had before the option existed."""
    assert deepreduce.build(dict(BASE, warmup=0)).config_digest == deepreduce.build(BASE).config_digest
    assert deepreduce.build(dict(BASE, warmup=5)).config_digest != deepreduce.build(BASE).config_digest


@pytest.mark.parametrize("config", [
    BASE,
    with_section("sparsifier", {"id": "randomk", "ratio": 0.3}),
    dict(with_section("value", {"id": "fp16"}), min_numel=0, nonfinite="raise"),
    dict(BASE, warmup=50),
])
def test_get_config_round_trips(config):
    pipe = deepreduce.build(config)
    again = deepreduce.build(deepreduce.load_config(pipe.get_config()))
    assert again == pipe and again.get_config() == pipe.get_config()


@pytest.mark.parametrize("config, words", [
    (with_section("sparsifier", {"id": "topk", "ratio": 2.0}), ["'ratio'", "2.0", "(0.0, 1.0]"]),
    (with_section("sparsifier", {"id": "topk", "ratio": "big"}), ["'ratio'", "number"]),
    (with_section("sparsifier", {"id": "topq"}), ["'topq'", "topk", "randomk"]),
    (with_section("sparsifier", {"id": "topk", "ration": 0.1}), ["'ration'", "ratio"]),
    (with_section("index", {"id": "nope"}), ["index", "'nope'", "raw"]),
    (with_section("value", {"ratio": 1}), ["value", "missing 'id'"]),
    (with_section("memory", 7), ["memory", "mapping"]),
    (dict(BASE, extra={"id": 1}), ["'extra'", "sparsifier"]),
    ({k: v for k, v in BASE.items() if k != "memory"}, ["missing section 'memory'"]),
    (dict(BASE, min_numel=-3), ["'min_numel'"]),
    (dict(BASE, nonfinite="ignore"), ["'nonfinite'", "propagate", "raise"]),
    (dict(BASE, warmup=-1), ["'warmup'", "steps", "-1"]),
    (dict(BASE, warmup=2.5), ["'warmup'", "2.5"]),
    (dict(BASE, warmup=True), ["'warmup'", "True"]),
])
def test_bad_configs_name_the_problem(config, words):
    with pytest.raises(ConfigError) as info:
        deepreduce.build(config)
    for word in words:
        assert word in str(info.value)
    assert isinstance(info.value, DeepReduceError)


def test_missing_and_invalid_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        deepreduce.load_config(str(tmp_path / "absent.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("sparsifier: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        deepreduce.load_config(str(bad))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        deepreduce.load_config(str(listy))


def test_registry_lists_every_kind():
    assert {"none", "topk", "randomk"} <= set(registry.ids("sparsifier"))
    assert "raw" in registry.ids("index") and {"raw", "fp16"} <= set(registry.ids("value"))
    assert {"none", "residual"} <= set(registry.ids("memory"))
    assert {"horovod", "mpi", "torch_distributed"} <= set(registry.ids("communicator"))
