import json
import shutil

import jax
import numpy as np
import pytest
from conftest import HF_FIXTURES
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxrl_scale.models.hf import CheckpointError, load_pretrained, save_pretrained
from jaxrl_scale.models.policy import init_policy
from jaxrl_scale.models.tokenizer import CharTokenizer


def _params(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _copy(arch, tmp_path):
    dst = tmp_path / arch
    shutil.copytree(HF_FIXTURES / arch, dst)
    return dst


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "qwen3_moe"])
@pytest.mark.parametrize("max_shard_bytes", [None, 60_000])
def test_round_trip_is_exact(arch, max_shard_bytes, tmp_path):
    model, tok = load_pretrained(HF_FIXTURES / arch)
    out = save_pretrained(model, tok, tmp_path / "out", max_shard_bytes=max_shard_bytes)
    sharded = (out / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_bytes is not None)
    again, tok2 = load_pretrained(out)
    assert again.cfg == model.cfg
    for a, b in zip(_params(model), _params(again), strict=True):
        np.testing.assert_array_equal(a, b)
    assert tok2.eos_ids == tok.eos_ids and tok2.pad_id == tok.pad_id
    assert tok2.encode("w3 w17 w40") == tok.encode("w3 w17 w40") == [5, 19, 42]
    # The written tensors are the original file's tensors, bit for bit (MoE: one per expert).
    if arch in ("qwen3", "qwen3_moe"):
        original = load_file(str(HF_FIXTURES / arch / "model.safetensors"))
        written = {}
        for f in out.glob("*.safetensors"):
            written.update(load_file(str(f)))
        assert set(written) == set(original)
        for name, array in original.items():
            np.testing.assert_array_equal(written[name], array)


def test_char_tokenizer_model_round_trip(tiny_model_config, tmp_path):
    model = init_policy(tiny_model_config, seed=5)
    tok = CharTokenizer("0123456789+-*= ")
    save_pretrained(model, tok, tmp_path)
    again, tok2 = load_pretrained(tmp_path)
    for a, b in zip(_params(model), _params(again), strict=True):
        np.testing.assert_array_equal(a, b)
    assert tok2.decode(tok2.encode("12 + 3 = 15")) == "12 + 3 = 15"
    assert tok2.eos_ids == (1,) and tok2.pad_id == 0


def test_missing_tensor_is_named(tmp_path):
    path = _copy("qwen3", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm"
    ):
        load_pretrained(path)


def test_shape_mismatch_is_named(tmp_path):
    path = _copy("qwen2", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((95, 64), np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*\(96, 64\)"
    ):
        load_pretrained(path)


def test_unexpected_tensor_is_named(tmp_path):
    path = _copy("qwen3", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros((128,), np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*q_proj\.bias"):
        load_pretrained(path)


def test_unsupported_architecture_is_named(tmp_path):
    path = _copy("qwen2", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture.*MistralForCausalLM"):
        load_pretrained(path)


def test_unsupported_rope_type_is_named(tmp_path):
    path = _copy("llama", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"]["rope_type"] = "yarn"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        load_pretrained(path)


def test_corrupt_weights_and_config_are_named(tmp_path):
    path = _copy("qwen2", tmp_path)
    (path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        load_pretrained(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_pretrained(path)


def test_missing_shard_file_is_named(tmp_path):
    path = _copy("llama", tmp_path)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors"):
        load_pretrained(path)


def test_missing_folder_files(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_pretrained(tmp_path)
