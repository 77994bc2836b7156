"""Config loading: every shipped config loads; broken files fail naming file, key, value and rule."""
from pathlib import Path

import pytest

from ep_comm.bench.config import ConfigError, load_config
from ep_comm.cli import configs
from ep_comm.cli.configs import available_configs, config_dir

SHIPPED = {
    # name: (num_experts, hidden, num_topk, tokens_per_rank)
    "cpu_demo": (16, 256, 4, 256),
    "deepseek_v3_prefill": (256, 7168, 8, 4096),
    "deepseek_v3_decode": (256, 7168, 8, 128),
    "qwen3_235b_a22b": (128, 4096, 8, 4096),
    "mixtral_8x7b": (8, 4096, 2, 4096),
    "gpt_oss_120b": (128, 2880, 4, 4096),
    "kimi_k2": (384, 7168, 8, 4096),
}

GOOD = """\
num_experts = 8
hidden = 64
num_topk = 2
tokens_per_rank = 32
dtype = "float32"
"""


def write(tmp_path: Path, text: str, name: str = "shape") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def test_shipped_configs_load_with_their_shapes():
    assert set(SHIPPED) <= set(available_configs())
    for name, shape in SHIPPED.items():
        cfg = load_config(name)
        assert cfg.name == name
        assert (cfg.num_experts, cfg.hidden, cfg.num_topk, cfg.tokens_per_rank) == shape
        assert cfg.dtype == "bfloat16"


def test_load_by_path_defaults_name_and_routing(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.name == "shape"
    assert cfg.routing.kind == "uniform" and cfg.routing.seed == 0
    assert load_config(str(write(tmp_path, GOOD))) == cfg


def test_routing_table_is_read(tmp_path):
    cfg = load_config(write(tmp_path, GOOD + '[routing]\nkind = "zipf"\nzipf_s = 1.5\nseed = 7\n'))
    assert (cfg.routing.kind, cfg.routing.zipf_s, cfg.routing.seed) == ("zipf", 1.5, 7)


def test_max_tokens_per_rank_defaults_to_4096_or_tokens_per_rank(tmp_path):
    assert load_config(write(tmp_path, GOOD)).max_tokens_per_rank == 4096
    assert load_config(write(tmp_path, GOOD + "max_tokens_per_rank = 64\n")).max_tokens_per_rank == 64
    big = GOOD.replace("tokens_per_rank = 32", "tokens_per_rank = 8192")
    assert load_config(write(tmp_path, big)).max_tokens_per_rank == 8192


def test_unknown_name_lists_known_configs():
    with pytest.raises(ConfigError, match=r"'no_such_model'.*cpu_demo"):
        load_config("no_such_model")


def test_missing_file_path():
    with pytest.raises(ConfigError, match="no such file"):
        load_config("/nonexistent/dir/x.toml")


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (GOOD.replace("hidden = 64", "hidden = -1"), r"hidden = -1: must be a positive integer"),
        (GOOD.replace("hidden = 64", "hidden = 64.0"), r"hidden = 64.0: must be a positive integer"),
        (GOOD.replace("num_topk = 2", "num_topk = true"), r"num_topk = True: must be a positive integer"),
        (GOOD.replace('"float32"', '"int8"'), r"dtype = 'int8': must be one of"),
        (GOOD.replace("num_topk = 2", "num_topk = 9"), r"num_topk = 9: must not exceed num_experts = 8"),
        (GOOD.replace("hidden = 64\n", ""), r"missing required key 'hidden'"),
        (GOOD + "hiden = 3\n", r"unknown key 'hiden'"),
        (GOOD + "[routing]\nknd = 'hot'\n", r"unknown key 'routing.knd'"),
        (GOOD + "[routing]\nkind = 'bursty'\n", r"routing.kind = 'bursty': must be one of"),
        (GOOD + "[routing]\nzipf_s = 0\n", r"routing.zipf_s = 0: must be a number > 0"),
        (GOOD + "[routing]\nhot_expert = 8\n", r"routing.hot_expert = 8: must be < num_experts = 8"),
        (GOOD + "routing = 3\n", r"routing = 3: must be a table"),
        (GOOD + "max_tokens_per_rank = 0\n", r"max_tokens_per_rank = 0: must be a positive integer"),
        (GOOD + "max_tokens_per_rank = 16\n", r"max_tokens_per_rank = 16: must not be below tokens_per_rank = 32"),
        ('name = "other"\n' + GOOD, r"name = 'other': must equal the file name 'shape'"),
        (GOOD + "hidden = [\n", r"not valid TOML"),
    ],
)
def test_invalid_configs_name_file_key_value_rule(tmp_path, edit, pattern):
    path = write(tmp_path, edit)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_config_dir_override(tmp_path, monkeypatch):
    write(tmp_path, GOOD, name="mine")
    monkeypatch.setenv("EP_COMM_CONFIG_DIR", str(tmp_path))
    assert available_configs() == ["mine"]
    assert load_config("mine").hidden == 64


def test_an_installed_wheel_reads_its_package_data_a_checkout_the_top_level_configs(tmp_path, monkeypatch):
    monkeypatch.delenv("EP_COMM_CONFIG_DIR", raising=False)
    package = tmp_path / "site-packages" / "ep_comm"
    (package / "configs").mkdir(parents=True)
    (tmp_path / "site-packages" / "configs").mkdir()
    monkeypatch.setattr(configs, "PACKAGE_DIR", package)
    assert config_dir() == package / "configs", "a wheel: ep_comm/configs"
    checkout = tmp_path / "checkout" / "ep_comm"
    checkout.mkdir(parents=True)
    monkeypatch.setattr(configs, "PACKAGE_DIR", checkout)
    assert config_dir() == tmp_path / "checkout" / "configs", "a checkout: configs/ beside ep_comm/"
