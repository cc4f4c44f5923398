"""A target folder with a broken config.json, weight file or tokenizer is refused in one line naming
the file, by the loader, the vLLM-side head reader and `specd generate` alike: never a traceback."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specd.cli.main import main
from specd.core.errors import CheckpointError
from specd.model import target as target_module
from specd.model.loading import load_target, read_config, read_target_head
from specd.model.target import LoadedTarget


def save_tiny_llama(folder: Path) -> None:
    """A tiny Llama checkpoint folder (config.json + model.safetensors), without a tokenizer."""
    import transformers

    # EOS 1: the tiny tokenizer's "</s>" (Llama's default, 2, would be a second stop token: "a")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder), safe_serialization=True)


def save_tiny_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of 30 ids (within the tiny model's 64), saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["<unk>", "</s>", *"abcdefghijklmnopqrstuvwxyz", "hi", "there"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>").save_pretrained(str(folder))


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny"
    save_tiny_llama(folder)
    save_tiny_tokenizer(folder)
    return folder


def generate_error(folder: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """`specd generate` on `folder`: asserts exit 2 and one clean line, returns that line."""
    capsys.readouterr()  # what making the folder printed (transformers' progress bars) is not under test
    code = main(["generate", "--prompt", "hi", "--target", str(folder), "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("specd: error:") and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize(("text", "says"), [
    ('{"architectures": ["Llama', "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('"LlamaForCausalLM"', "expected a JSON object, got str"),
    ("\udcff", "cannot be read"),
])
def test_a_config_json_that_is_not_a_json_object_is_refused_naming_it(tiny_folder: Path, text: str, says: str,
                                                                       capsys) -> None:
    config_file = tiny_folder / "config.json"
    config_file.write_bytes(text.encode("utf-8", errors="surrogateescape"))
    for read in (read_config, load_target, read_target_head):
        with pytest.raises(CheckpointError, match=says) as refused:
            read(tiny_folder)
        assert str(config_file) in str(refused.value)
    assert str(config_file) in generate_error(tiny_folder, capsys)


@pytest.mark.parametrize(("field", "value"), [
    ("architectures", 5), ("architectures", [["LlamaForCausalLM"]]), ("rope_parameters", [1, 2]),
    ("rope_parameters", {"rope_type": "llama3"}), ("num_attention_heads", 0), ("hidden_size", None),
    ("vocab_size", "many"),
])
def test_a_config_field_of_the_wrong_type_is_refused_naming_the_file(tiny_folder: Path, field: str,
                                                                      value: object) -> None:
    config_file = tiny_folder / "config.json"
    config = json.loads(config_file.read_text())
    config[field] = value
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape(str(config_file))):
        read_config(tiny_folder)


def _garbage(data: bytes) -> bytes:
    return b"\xff" * 100


def _header_cut(data: bytes) -> bytes:
    return data[:500]


def _data_cut(data: bytes) -> bytes:
    return data[:-1000]


@pytest.mark.parametrize("spoil", [_garbage, _header_cut, _data_cut, lambda data: b""])
def test_a_garbage_or_truncated_weight_file_is_refused_naming_it(tiny_folder: Path, spoil: Callable[[bytes], bytes],
                                                                 capsys) -> None:
    weights = tiny_folder / "model.safetensors"
    weights.write_bytes(spoil(weights.read_bytes()))
    # read_target_head serves the vLLM plugin, which reports a SpecdError (CheckpointError) as a clear error
    for read in (load_target, read_target_head):
        with pytest.raises(CheckpointError, match="not a readable safetensors file") as refused:
            read(tiny_folder)
        assert str(weights) in str(refused.value)
    assert str(weights) in generate_error(tiny_folder, capsys)


def test_a_folder_without_a_tokenizer_is_refused_in_one_line_before_the_weights_load(
        tmp_path: Path, monkeypatch, capsys) -> None:
    save_tiny_llama(tmp_path)

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded before the tokenizer was checked")

    monkeypatch.setattr(target_module, "load_target", no_weights)
    with pytest.raises(CheckpointError, match=r"no tokenizer \(none of tokenizer\.json"):
        LoadedTarget.load(tmp_path)
    assert "no tokenizer" in generate_error(tmp_path, capsys)


def test_a_broken_tokenizer_file_is_refused_in_one_line(tiny_folder: Path, capsys) -> None:
    (tiny_folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    assert "no usable tokenizer" in generate_error(tiny_folder, capsys)


def test_a_sound_tiny_folder_still_generates(tiny_folder: Path, capsys) -> None:
    code = main(["generate", "--prompt", "hi there", "--target", str(tiny_folder), "--max-tokens", "3", "--json"])
    assert code == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3


def test_stop_tokens_are_the_tokenizers_eos_and_those_generation_config_lists(tmp_path) -> None:
    from types import SimpleNamespace

    from specd.model.target import LoadedTarget

    def stops(generation_config: str | None, eos: int | None = 2) -> tuple[int, ...]:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        if generation_config is not None:
            (folder / "generation_config.json").write_text(generation_config)
        return LoadedTarget(folder, None, SimpleNamespace(eos_token_id=eos)).eos_token_ids  # type: ignore[arg-type]

    assert stops(None) == (2,)
    assert stops('{"eos_token_id": [2, 7, 9]}') == (2, 7, 9)   # a chat model's end of turn besides EOS
    assert stops('{"eos_token_id": 5}', eos=None) == (5,)
    assert stops('{"eos_token_id": ["x", true, -1]}') == (2,)   # nothing usable: the tokenizer's alone
    assert stops("not json") == (2,)
