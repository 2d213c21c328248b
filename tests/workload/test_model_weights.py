"""The model-folder check reads every safetensors header and refuses, naming the file and the reason,
what a worker's loader would refuse or load wrong: corrupt headers and offsets, bad shard indexes,
tensors that do not fit config.json's architecture. Names and shapes are checked against models
transformers itself makes."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rlctl.workload.modeldir import ModelDirError, check_model_dir, check_weights
from rlctl.workload.safetensors_header import DTYPE_BITS, INDEX_FILE, MAX_HEADER_BYTES, SINGLE_FILE
from tests.hf_models import tiny_model

Header = dict[str, Any]


def write_raw(path: Path, header: Header, data_bytes: int, length: int | None = None) -> None:
    """A safetensors file with ``header`` as given and ``data_bytes`` zero bytes of data."""
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded) if length is None else length) + encoded + bytes(data_bytes))


def packed(tensors: dict[str, tuple[str, list[int]]]) -> tuple[Header, int]:
    """A header laying ``tensors`` (name: dtype, shape) out back to back, and its data size."""
    header: Header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = DTYPE_BITS[dtype] // 8
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


def tensors_of(path: Path) -> dict[str, tuple[str, list[int]]]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return {name: (info["dtype"], info["shape"]) for name, info in header.items()}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A copy of the tiny Qwen3 (tied embeddings, 4 layers, hidden 128) to corrupt."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3"), folder)
    return folder


def refusal(folder: Path) -> str:
    with pytest.raises(ModelDirError) as caught:
        check_model_dir(folder, load_config=False)
    return str(caught.value)


def repacked(folder: Path, edit: Callable[[dict[str, tuple[str, list[int]]]], object]) -> Path:
    """Rewrite ``folder``'s model.safetensors with its tensors edited, laid out validly."""
    tensors = tensors_of(folder / SINGLE_FILE)
    edit(tensors)
    write_raw(folder / SINGLE_FILE, *packed(tensors))
    return folder


def test_an_intact_model_passes_and_says_what_was_checked(model: Path) -> None:
    assert check_model_dir(model, load_config=False).weights_check == "46 tensors in 1 file(s) match Qwen3ForCausalLM (config.json)"
    llama = check_model_dir(tiny_model("llama"), load_config=False).summary()
    assert llama["weights_check"] == "38 tensors in 1 file(s) match LlamaForCausalLM (config.json)"
    repacked(model, lambda tensors: None)  # the tests' own writer makes a valid file
    assert check_model_dir(model, load_config=False).weights_check.startswith("46 tensors in 1 file(s) match")


def test_random_bytes_are_refused_by_their_header_length(model: Path) -> None:
    (model / SINGLE_FILE).write_bytes(random.Random(0).randbytes(100))
    message = refusal(model)
    assert message.startswith(f"{model / SINGLE_FILE}: header length ") and "exceeds the file (100 bytes)" in message
    (model / SINGLE_FILE).write_bytes(b"short")
    assert "5 bytes, too short for a safetensors file" in refusal(model)


def test_a_header_over_safetensors_limit_is_refused(model: Path) -> None:
    path = model / SINGLE_FILE
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{")
    os.truncate(path, MAX_HEADER_BYTES + 64)  # sparse: nothing that large is written
    assert f"header length {MAX_HEADER_BYTES + 1} exceeds safetensors' limit" in refusal(model)


def test_a_header_that_is_not_json_is_refused(model: Path) -> None:
    (model / SINGLE_FILE).write_bytes(struct.pack("<Q", 4) + b"nope" + bytes(8))
    assert "the 4-byte header is not a JSON object" in refusal(model)
    header = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}'
    (model / SINGLE_FILE).write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    assert "'a' appears twice" in refusal(model)


def test_a_truncated_data_section_names_the_tensor_past_its_end(model: Path) -> None:
    path = model / SINGLE_FILE
    os.truncate(path, path.stat().st_size - 100)
    message = refusal(model)
    assert f"{path}: tensor model.norm.weight: bytes [3336192, 3336704) lie outside the data section (3336604 bytes)" in message


def test_unknown_dtypes_and_malformed_entries_are_refused(model: Path) -> None:
    header, size = packed({"w": ("F32", [2, 2])})
    header["w"]["dtype"] = "F17"
    write_raw(model / SINGLE_FILE, header, size)
    assert "tensor w: unknown dtype 'F17'" in refusal(model)
    header["w"].update(dtype="F32", shape=[2, -2])
    write_raw(model / SINGLE_FILE, header, size)
    assert "tensor w: shape [2, -2] is not a list of non-negative integers" in refusal(model)
    header["w"].update(shape=[2, 2], data_offsets=[0])
    write_raw(model / SINGLE_FILE, header, size)
    assert "tensor w: data_offsets [0] is not two non-negative integers" in refusal(model)


def test_offsets_out_of_bounds_overlapping_or_leaving_gaps_are_refused(model: Path) -> None:
    path = model / SINGLE_FILE
    header, size = packed({"a": ("F32", [4]), "b": ("F32", [4])})
    header["b"]["data_offsets"] = [16, 48]
    write_raw(path, header, size)
    message = refusal(model)
    assert f"{path}: tensor b: bytes [16, 48) lie outside the data section (32 bytes)" in message
    assert "tensor b: holds 32 bytes; F32 [4] takes 16" in message

    header["b"]["data_offsets"] = [8, 24]
    write_raw(path, header, 24)
    assert "tensor b: bytes [8, 24) overlap tensor a's [0, 16)" in refusal(model)

    header["b"]["data_offsets"] = [20, 36]
    write_raw(path, header, 36)
    assert f"{path}: data section bytes [16, 20) belong to no tensor" in refusal(model)

    header["b"]["data_offsets"] = [16, 32]
    write_raw(path, header, 40)
    assert f"{path}: data section bytes [32, 40) belong to no tensor" in refusal(model)

    header["b"]["data_offsets"] = [32, 16]
    write_raw(path, header, 32)
    assert "tensor b: data_offsets bytes [32, 16) end before they begin" in refusal(model)


def test_a_missing_tensor_is_named(model: Path) -> None:
    repacked(model, lambda t: t.pop("model.layers.3.mlp.down_proj.weight"))
    assert refusal(model) == (f"{model / SINGLE_FILE}: tensor model.layers.3.mlp.down_proj.weight is missing "
                              "(Qwen3ForCausalLM with config.json's sizes has it)")


def test_a_layer_past_num_hidden_layers_is_named(model: Path) -> None:
    repacked(model, lambda t: t.update({"model.layers.4.mlp.up_proj.weight": ("F32", [384, 128])}))
    assert refusal(model) == (f"{model / SINGLE_FILE}: tensor model.layers.4.mlp.up_proj.weight: layer 4 is out of "
                              "range (config.json: num_hidden_layers = 4)")


def test_a_wrong_shape_is_named(model: Path) -> None:
    repacked(model, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": ("F32", [128, 128])}))
    assert refusal(model) == (f"{model / SINGLE_FILE}: tensor model.layers.0.self_attn.k_proj.weight has shape "
                              "[128, 128]; Qwen3ForCausalLM with config.json's sizes makes it [64, 128]")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 400}))
    repacked(model, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": ("F32", [64, 128])}))
    assert "tensor model.embed_tokens.weight has shape [360, 128]; Qwen3ForCausalLM with config.json's sizes " \
           "makes it [400, 128]" in refusal(model)


def test_lm_head_may_be_left_out_only_when_tied(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    assert "tensor lm_head.weight is missing" in refusal(model)
    repacked(model, lambda t: t.update({"lm_head.weight": ("F32", [360, 128])}))
    assert check_model_dir(model, load_config=False).weights_check.startswith("47 tensors in 1 file(s) match")


def test_an_architecture_without_a_parameter_list_is_checked_for_structure_only(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    repacked(model, lambda t: t.update({"transformer.h.0.attn.weight": ("BF16", [3, 3])}))
    gpt2 = {**config, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    assert check_weights(model, gpt2).startswith("47 tensors in 1 file(s); structure only: no parameter list for "
                                                 "GPT2LMHeadModel (known: LlamaForCausalLM,")
    quantized = {**config, "quantization_config": {"quant_method": "fp8"}}
    assert check_weights(model, quantized).endswith("structure only: a quantized checkpoint (config.json has "
                                                    "quantization_config)")
    assert check_weights(model, config).endswith("1 tensor(s) it does not use: transformer.h.0.attn.weight")
    os.truncate(model / SINGLE_FILE, (model / SINGLE_FILE).stat().st_size - 2)
    with pytest.raises(ModelDirError, match="lie outside the data section"):
        check_weights(model, gpt2)  # structure is still checked


def shard(folder: Path, groups: dict[str, list[str]], weight_map: dict[str, str] | None = None) -> None:
    """Split ``folder``'s model.safetensors into shards (file name: tensor names) with an index."""
    tensors = tensors_of(folder / SINGLE_FILE)
    (folder / SINGLE_FILE).unlink()
    for file_name, names in groups.items():
        write_raw(folder / file_name, *packed({name: tensors[name] for name in names}))
    mapping = weight_map or {name: file_name for file_name, names in groups.items() for name in names}
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": mapping}))


def halves(folder: Path) -> dict[str, list[str]]:
    names = sorted(tensors_of(folder / SINGLE_FILE))
    return {"model-00001-of-00002.safetensors": names[:20], "model-00002-of-00002.safetensors": names[20:]}


def test_a_sharded_model_checks_every_shard_against_the_index(model: Path) -> None:
    groups = halves(model)
    shard(model, groups)
    assert check_model_dir(model, load_config=False).weights_check.startswith("46 tensors in 2 file(s) match Qwen3")
    second = model / "model-00002-of-00002.safetensors"
    second.write_bytes(os.urandom(64))
    assert refusal(model).startswith(f"{second}: header length")


def test_an_index_that_names_the_wrong_shard_is_refused(model: Path) -> None:
    groups = halves(model)
    first, second = groups
    moved = groups[first][0]
    shard(model, groups, {**{n: f for f, names in groups.items() for n in names}, moved: second})
    assert f"{model / INDEX_FILE}: tensor {moved} is mapped to {second}, which does not hold it (it is in {first})" \
        in refusal(model)


@pytest.mark.parametrize("case", ["duplicated", "not in index", "missing"])
def test_duplicated_unindexed_or_missing_tensors_of_a_sharded_model_are_refused(model: Path, case: str) -> None:
    groups = halves(model)
    first, second = groups
    mapping = {name: file_name for file_name, names in groups.items() for name in names}
    some = groups[second][0]
    if case == "duplicated":
        groups[first].append(some)
        shard(model, groups, mapping)
        assert f"{model / INDEX_FILE}: tensor {some} is in several shards: {first}, {second}" in refusal(model)
    elif case == "not in index":
        del mapping[some]
        shard(model, groups, mapping)
        assert f"{model / second}: tensor {some} is not in the index {INDEX_FILE}" in refusal(model)
    else:
        groups[second].remove(some)
        shard(model, groups, mapping)
        assert f"{model / INDEX_FILE}: tensor {some} is mapped to {second}, which does not hold it" in refusal(model)


@pytest.mark.parametrize(("index_text", "reason"), [
    ("{not json", "not a readable safetensors index"),
    ('{"metadata": {}}', "expected a non-empty 'weight_map'"),
    ('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "'a' appears twice"),
    ('{"weight_map": {"a": "../elsewhere.safetensors"}}', "not a file name in this folder"),
    ('{"weight_map": {"a": "absent.safetensors"}}', "shards that are missing: absent.safetensors"),
])
def test_a_bad_index_is_refused_naming_it(model: Path, index_text: str, reason: str) -> None:
    (model / SINGLE_FILE).unlink()
    (model / INDEX_FILE).write_text(index_text)
    message = refusal(model)
    assert str(model) in message and reason in message


def test_both_weight_sources_are_checked_where_both_are_there(model: Path) -> None:
    tensors = tensors_of(model / SINGLE_FILE)
    write_raw(model / "model-00001-of-00001.safetensors", *packed(tensors))
    (model / INDEX_FILE).write_text(json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors" for n in tensors}}))
    assert check_model_dir(model, load_config=False).weights_check.count("match Qwen3ForCausalLM") == 2
    (model / SINGLE_FILE).write_bytes(os.urandom(100))  # transformers loads this one when both are there
    assert refusal(model).startswith(f"{model / SINGLE_FILE}: header length")


SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize(("config_class", "extra"), [
    ("LlamaConfig", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}),
    ("LlamaConfig", {"tie_word_embeddings": True, "head_dim": 16}),
    ("MistralConfig", {"tie_word_embeddings": False}),
    ("Qwen2Config", {"tie_word_embeddings": True}),
    ("Qwen3Config", {"tie_word_embeddings": False, "attention_bias": True, "head_dim": 8}),
])
def test_the_derived_names_and_shapes_are_transformers_own(tmp_path: Path, config_class: str, extra: dict[str, Any]) -> None:
    import torch
    import transformers

    config = getattr(transformers, config_class)(**SMALL, **extra)
    with torch.random.fork_rng(devices=[]):
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    summary = check_weights(tmp_path, written)
    assert f"match {written['architectures'][0]} (config.json)" in summary and "does not use" not in summary, summary
