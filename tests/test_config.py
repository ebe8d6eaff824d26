import pytest
from conftest import ROOT

from jaxrl_scale.config import ConfigError, ExperimentConfig, RopeScalingConfig, load_config

DEMO = "asset:demo.yaml"  # shipped inside the package


def test_demo_yaml_loads_into_typed_config():
    cfg = load_config(DEMO)
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.model.architecture == "qwen2"
    assert cfg.model.qkv_bias is True
    assert cfg.mesh.data == -1


def test_overrides_set_nested_values_and_parse_yaml_scalars():
    cfg = load_config(
        DEMO,
        ["model.num_layers=3", "model.rms_norm_eps=1e-5", "seed=7", "model.lm_head_dtype=bfloat16"],
    )
    assert cfg.model.num_layers == 3
    assert cfg.model.rms_norm_eps == pytest.approx(1e-5)  # "1e-5" is a string to YAML 1.1
    assert cfg.seed == 7
    assert cfg.model.lm_head_dtype == "bfloat16"


def test_override_can_create_optional_section():
    cfg = load_config(DEMO, ["model.rope_scaling.factor=4"])
    assert cfg.model.rope_scaling == RopeScalingConfig(factor=4.0)


def test_config_is_frozen():
    cfg = load_config(DEMO)
    with pytest.raises(AttributeError):
        cfg.seed = 3


def test_typo_names_key_and_closest_valid_key():
    with pytest.raises(ConfigError, match=r"'model\.num_layer'.*did you mean 'model\.num_layers'"):
        load_config(DEMO, ["model.num_layer=3"])


def test_unknown_section_is_an_error():
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'.*did you mean 'model'"):
        load_config(DEMO, ["modle.num_layers=3"])


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.num_layers=three", "model.num_layers"),
        ("model.dtype=float16", "model.dtype"),
        ("model.tie_embeddings=[1, 2]", "model.tie_embeddings"),
        ("seed=1.5", "seed"),
    ],
)
def test_wrong_type_names_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(DEMO, [override])


def test_a_value_outside_a_choice_lists_the_choices():
    with pytest.raises(ConfigError, match="sampler.batching: expected one of 'auto', "
                                          "'static', 'continuous', got 'dynamic'"):  # fmt: skip
        load_config(DEMO, ["sampler.batching=dynamic"])
    with pytest.raises(ConfigError, match="loss.kind: expected one of 'cispo', 'dapo'"):
        load_config(DEMO, ["loss.kind=ppo"])
    for override in ("sampler.slots=-1", "sampler.admit_every=0"):
        with pytest.raises(ConfigError, match=override.split("=")[0]):
            load_config(DEMO, [override])


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.vocab_size=0", "model.vocab_size"),
        ("model.num_kv_heads=3", "model.num_kv_heads"),
        ("model.rms_norm_eps=-1", "model.rms_norm_eps"),
        ("mesh.tensor=0", "mesh.tensor"),
        ("model.rope_scaling.factor=0.5", "model.rope_scaling.factor"),
        ("model.matmul_precision=fastest", "model.matmul_precision"),
        (
            "sampler.interruption={text: '12', think_min: 4, think_max: 5, answer_budget: 2}",
            "sampler.max_new_tokens",
        ),
        (
            "sampler.interruption={text: '12', think_min: 3, think_max: 2, answer_budget: 2}",
            "sampler.interruption.think_min",
        ),
    ],
)
def test_out_of_range_names_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(DEMO, [override])


@pytest.mark.parametrize("override", ["sampler.top_p=0.95", "sampler.top_k=50"])
def test_truncated_sampling_is_refused_for_rl_with_the_reason(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".*biased"):
        load_config(DEMO, [override])


def test_malformed_override_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(DEMO, ["model.num_layers"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="'seed' is not a section"):
        load_config(DEMO, ["seed.x=1"])


def test_base_file_is_read_first_and_overridden(tmp_path):
    (tmp_path / "arms").mkdir()
    (tmp_path / "base.yaml").write_text("seed: 3\nmodel: {num_layers: 4, hidden_size: 96}\n")
    arm = tmp_path / "arms" / "arm.yaml"
    arm.write_text("base: ../base.yaml\nmodel: {num_layers: 2}\nloss: {kind: dapo}\n")
    cfg = load_config(arm, ["seed=5"])
    assert (cfg.seed, cfg.model.num_layers, cfg.model.hidden_size) == (5, 2, 96)
    assert cfg.loss.kind == "dapo"
    loop = tmp_path / "loop.yaml"
    loop.write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="include each other"):
        load_config(loop)
    missing = tmp_path / "missing.yaml"
    missing.write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="nowhere.yaml: no such config file"):
        load_config(missing)


def test_shipped_configs_and_ablation_arms_load():
    paths = sorted((ROOT / "configs").rglob("*.yaml"))
    assert len(paths) >= 8
    for path in paths:
        load_config(path)
    qwen = load_config(ROOT / "configs" / "scalerl_qwen2.5-0.5b_math.yaml")
    assert qwen.task.name == "math" and qwen.loss.kind == "cispo"
    assert qwen.pipeline.mode == "pipeline_rl" and qwen.pipeline.max_staleness == 8
    assert qwen.model.lm_head_dtype == "float32"
    prompt = qwen.task.math.template.format(question="What is 1+1?")
    assert "\\boxed{}" in prompt and "What is 1+1?" in prompt
    arm = load_config(ROOT / "configs" / "ablations" / "qwen2.5-0.5b_math_dapo.yaml")
    assert arm.loss.kind == "dapo" and arm.train == qwen.train and arm.optim == qwen.optim
    study = load_config(ROOT / "configs" / "study" / "sync.yaml")  # base: asset:demo.yaml
    assert study.pipeline.mode == "sync" and study.task == load_config(DEMO).task


@pytest.mark.parametrize(
    "old, new",
    [
        ("train.learning_rate=1e-3", "optim.learning_rate"),
        ("train.sft_steps=10", "warm_start.steps"),
        ("train.sft_learning_rate=1e-3", "warm_start.optim.learning_rate"),
        ("task.max_digits=1", "task.arithmetic.max_digits"),
        ("task.numbers=4", "task.countdown.numbers"),
        ("task.data=x.jsonl", "task.math.data"),
    ],
)
def test_a_key_that_moved_section_names_its_new_place(old, new):
    with pytest.raises(ConfigError, match=f"'{old.split('=')[0]}' is now '{new}'"):
        load_config(DEMO, [old])


def test_task_sections_and_the_optimisers_are_their_own():
    cfg = load_config(
        DEMO,
        [
            "task.countdown.numbers=4",
            "optim.learning_rate=0.5",
            "warm_start.optim.learning_rate=0.25",
        ],
    )
    assert cfg.task.countdown.numbers == 4 and cfg.task.arithmetic.max_digits == 2
    assert cfg.optim.learning_rate == 0.5 and cfg.warm_start.optim.learning_rate == 0.25
    with pytest.raises(ConfigError, match="task.countdown.numbers"):
        load_config(DEMO, ["task.countdown.numbers=9"])
    with pytest.raises(ConfigError, match="warm_start.optim|optim.learning_rate"):
        load_config(DEMO, ["warm_start.optim.learning_rate=0"])


def test_dump_config_reads_back_equal():
    import tempfile
    from pathlib import Path

    from jaxrl_scale.config import dump_config

    cfg = load_config(ROOT / "configs" / "scalerl_qwen2.5-0.5b_math.yaml", ["seed=4"])
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.yaml"
        path.write_text(dump_config(cfg, header="a\nb"))
        assert path.read_text().startswith("# a\n# b\n")
        assert load_config(path) == cfg


@pytest.mark.parametrize(
    "mode,batching,expected",
    [
        ("pipeline_rl", "auto", "continuous"),
        ("sync", "auto", "static"),
        ("ppo_off_policy", "auto", "static"),
        ("pipeline_rl", "static", "static"),
        ("sync", "continuous", "continuous"),
    ],
)
def test_auto_batching_is_continuous_in_pipeline_rl_only(mode, batching, expected):
    cfg = load_config(DEMO, [f"pipeline.mode={mode}", f"sampler.batching={batching}"])
    assert cfg.batching == expected


def test_slots_that_cannot_hold_a_group_are_refused():
    with pytest.raises(ConfigError, match="sampler.slots: 4 cannot hold one group of"):
        load_config(ROOT / "configs" / "tiny_arithmetic.yaml", ["sampler.slots=4",
                                                                 "train.group_size=8"])  # fmt: skip
