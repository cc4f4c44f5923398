"""The feature drafter in vLLM's EAGLE-3 format, and the eagle3 route's pieces that run without vLLM:
the exported folder, the in-place install into a vLLM-shaped module tree, the plugin's switch and
the launch settings. vLLM itself serving the export is in test_vllm_eagle3.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from specd.core.errors import CheckpointError, ConfigurationError
from specd.drafter.checkpoint import load_drafter, read_metadata
from specd.drafter.feature_model import FeatureDrafterModel, new_feature_drafter
from specd.drafter.vllm_format import SPECD_CHECKPOINT, checkpoint_tensors, export_eagle3, vllm_parameters
from specd.model import packed_linear, row_kernel
from specd.model.fingerprint import TargetFingerprint
from specd.model.transformer import Transformer
from specd.serving.vllm.eagle3 import plugin
from specd.serving.vllm.eagle3.companion import VllmDrafterSlot
from specd.serving.vllm.eagle3.weights import (
    InPlaceKernel,
    Prepared,
    drafter_gemm_dtype,
    install,
    prepare,
    vllm_cpu_in_place_kernel,
    vllm_cpu_repack,
    with_gemm_dtype,
    with_half_kernel,
)
from specd.serving.vllm.shared.launch import PluginSettings, speculative_config
from specd.testing import tiny_target

# vLLM 0.32's Eagle3LlamaForCausalLM parameters for a one-layer drafter reading 2 target layers
VLLM_NAMES = {"model.fc_norm.0.weight", "model.fc_norm.1.weight", "model.fc.weight",
              "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
              "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
              "model.layers.0.post_attention_layernorm.weight", "model.layers.0.mlp.gate_up_proj.weight",
              "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id"}


def drafter(target: Transformer, seed: int = 0, num_layers: int = 1) -> FeatureDrafterModel:
    draft_ids = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:40]
    model = new_feature_drafter(target.config, target.embed.weight.float(), target.lm_head.weight.float(),
                                target.norm.weight.float(), draft_ids, seed=seed, num_layers=num_layers)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return model


def target_folder(tmp_path: Path) -> Path:
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"rope_theta": 12345.0,
                                                                 "max_position_embeddings": 512}))
    return tmp_path / "target"


def test_export_writes_eagle3s_config_and_checkpoint_names_and_specds_copy(tmp_path: Path) -> None:
    target = tiny_target().float()
    model = drafter(target)
    fingerprint = TargetFingerprint.of(target.config)
    folder = export_eagle3(model, tmp_path / "export", target_folder(tmp_path), fingerprint, "7")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Eagle3LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2]  # after layers 0 and 1
    assert config["draft_vocab_size"] == 40 and config["fc_norm"] is True
    assert config["rope_theta"] == 12345.0 and config["max_position_embeddings"] == 512
    tensors = load_file(str(folder / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in tensors and "midlayer.mlp.up_proj.weight" in tensors
    assert not any("embed" in name for name in tensors)  # vLLM shares the target's embedding
    # vLLM maps a draft index i to target id i + d2t[i]
    assert torch.equal(torch.arange(40) + tensors["d2t"], model.draft_ids)
    q, k, v = (tensors[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(torch.cat([q, k, v]), model.attn.qkv.weight.detach())
    # only *.safetensors beside config.json are vLLM's: specd's own copy sits in a subfolder
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors"]
    copy = load_drafter(folder / SPECD_CHECKPOINT, fingerprint, target_embedding=target.embed.weight.float())
    assert read_metadata(folder / SPECD_CHECKPOINT)["specd_version"] == "7"
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), model.state_dict().values(),
                                                 strict=True))


def test_vllm_parameters_use_vllms_loaded_names_and_stacking() -> None:
    target = tiny_target().float()
    model = drafter(target)
    parameters = vllm_parameters(model)
    assert set(parameters) == VLLM_NAMES
    checkpoint = checkpoint_tensors(model)
    gate, up = checkpoint["midlayer.mlp.gate_proj.weight"], checkpoint["midlayer.mlp.up_proj.weight"]
    assert torch.equal(parameters["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([gate, up]))


def test_a_two_layer_drafter_exports_its_second_layer_as_vllm_stacks_llama_layers(tmp_path: Path) -> None:
    target = tiny_target().float()
    model = drafter(target, num_layers=2)
    parameters = vllm_parameters(model)
    second = {name for name in parameters if name.startswith("model.layers.1.")}
    assert second == {"model.layers.1." + name for name in (
        "input_layernorm.weight", "self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
        "post_attention_layernorm.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")}
    assert set(parameters) - second == VLLM_NAMES  # the first layer is EAGLE-3's, as before
    fingerprint = TargetFingerprint.of(target.config)
    folder = export_eagle3(model, tmp_path / "export", target_folder(tmp_path), fingerprint, "3")
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 2
    tensors = load_file(str(folder / "model.safetensors"))
    q, k, v = (tensors[f"layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(torch.cat([q, k, v]), model.deeper_layers[0].attn.qkv.weight.detach())
    copy = load_drafter(folder / SPECD_CHECKPOINT, fingerprint, target_embedding=target.embed.weight.float())
    assert copy.config.num_layers == 2
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), model.state_dict().values(),
                                                 strict=True))


class PackedLinear(nn.Module):
    """vLLM's CPU linear layer after loading: the weight packed away, an empty parameter left."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        packed = weight.clone()
        self.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        self.cpu_linear = lambda x, w, b: x @ packed.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cpu_linear(x, self.weight, None)


def test_install_unpacks_cpu_layers_once_then_swaps_in_place() -> None:
    layer = PackedLinear(torch.zeros(3, 4))
    tree = nn.Module()
    tree.add_module("proj", layer)
    tree.register_parameter("norm", nn.Parameter(torch.ones(4), requires_grad=False))
    x = torch.randn(2, 4)
    first = {"proj.weight": torch.randn(3, 4), "norm": torch.full((4,), 2.0)}
    install(tree, first)
    assert torch.allclose(layer(x), x @ first["proj.weight"].T) and torch.equal(tree.norm, first["norm"])
    weight = layer.weight
    second = {"proj.weight": torch.randn(3, 4), "norm": torch.full((4,), 3.0)}
    install(tree, second)
    assert layer.weight is weight  # the same parameter, new values: compiled graphs see the swap
    assert torch.allclose(layer(x), x @ second["proj.weight"].T)
    with pytest.raises(CheckpointError, match="shape"):
        install(tree, {"proj.weight": torch.randn(5, 4)})


def test_install_in_eager_mode_packs_every_new_weight_again_as_vllm_does() -> None:
    layer = PackedLinear(torch.zeros(3, 4))
    tree = nn.Module()
    tree.add_module("proj", layer)
    packed: list[tuple[str, torch.Tensor]] = []  # (thread, weight) of every packing

    def repack(module: nn.Module) -> None:  # stands in for vLLM's dispatch_cpu_unquantized_gemm
        weight = module.weight.detach().clone()
        packed.append((threading.current_thread().name, weight))
        module.cpu_linear = lambda x, w, b: x @ weight.T

    x = torch.randn(2, 4)
    first = {"proj.weight": torch.randn(3, 4)}
    install(tree, first, repack)  # as at attach, on the decoding thread
    assert torch.equal(packed[-1][1], first["proj.weight"]) and torch.allclose(layer(x), x @ first["proj.weight"].T)
    # a swap: vLLM's packing runs where the version is prepared, installing only hands the layer its result
    new = {"proj.weight": torch.randn(3, 4)}
    prepared: list[Prepared] = []
    swapper = threading.Thread(target=lambda: prepared.append(prepare(tree, new, repack=repack)), name="swapper")
    swapper.start()
    swapper.join()
    assert torch.allclose(layer(x), x @ first["proj.weight"].T), "preparing changed the serving layer"
    install(tree, prepared[0], repack)
    assert [thread for thread, _ in packed] == ["MainThread", "swapper"]
    assert torch.allclose(layer(x), x @ new["proj.weight"].T) and torch.equal(layer.weight, new["proj.weight"])


def test_eager_layers_in_bfloat16_compute_from_a_bfloat16_copy_and_answer_in_the_servers_dtype() -> None:
    layer = PackedLinear(torch.zeros(8, 16))
    tree = nn.Module()
    tree.add_module("proj", layer)
    packed: list[torch.dtype] = []

    def repack(module: nn.Module) -> None:  # stands in for vLLM's dispatch: computes with the dtype it packed
        weight = module.weight.detach().clone()
        packed.append(weight.dtype)
        module.cpu_linear = lambda x, w, b: x @ weight.T

    in_bf16 = with_gemm_dtype(repack, torch.bfloat16)
    x = torch.randn(3, 16)
    for version in (torch.randn(8, 16), torch.randn(8, 16)):
        install(tree, prepare(tree, {"proj.weight": version}, repack=in_bf16), in_bf16)
        out = layer(x)
        expected = x @ version.T
        assert out.dtype == torch.float32 and not torch.equal(out, expected)  # computed in bfloat16 ...
        assert torch.allclose(out, expected, rtol=0.03, atol=0.03 * float(expected.abs().max()))  # ... near float32
        assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, version)  # the version itself kept
    assert packed == [torch.bfloat16, torch.bfloat16]


def test_the_drafters_gemm_dtype_halves_a_float32_servers_weights_where_asked_or_native() -> None:
    assert drafter_gemm_dtype("native", torch.float32) is None
    assert drafter_gemm_dtype("bfloat16", torch.float32) is torch.bfloat16
    assert drafter_gemm_dtype("bfloat16", torch.bfloat16) is None  # already bfloat16: nothing to change
    assert drafter_gemm_dtype("auto", torch.bfloat16) is None
    assert drafter_gemm_dtype("float16", torch.bfloat16) is None
    kernel = row_kernel.row_kernel()
    half = torch.float16 if kernel is not None and kernel.has_half else None
    assert drafter_gemm_dtype("float16", torch.float32) is half
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert drafter_gemm_dtype("auto", torch.float32) is (torch.bfloat16 if native else half)


def test_eager_layers_in_float16_multiply_few_rows_through_the_kernel_and_more_through_vllms_packing() -> None:
    kernel = row_kernel.row_kernel()
    if kernel is None or not kernel.has_half:
        pytest.skip("this CPU converts no fp16 (no F16C): float32 servers keep float32 drafter layers")
    layer = PackedLinear(torch.zeros(40, 24))
    tree = nn.Module()
    tree.add_module("proj", layer)

    def repack(module: nn.Module) -> None:  # stands in for vLLM's dispatch: float32, a product of its own
        weight = module.weight.detach().clone()
        module.cpu_linear = lambda x, w, b: (x.double() @ weight.double().T).float()

    in_half = with_half_kernel(repack, kernel)
    generator = torch.Generator().manual_seed(0)
    for version in (torch.randn(40, 24, generator=generator), torch.randn(40, 24, generator=generator)):
        install(tree, prepare(tree, {"proj.weight": version}, repack=in_half), in_half)
        many_rows = packed_linear.KERNEL_MAX_ROWS + 8  # past what the kernel serves on this CPU
        few, many = torch.randn(2, 3, 24, generator=generator), torch.randn(many_rows, 24, generator=generator)
        rounded = version.to(torch.float16).float()
        assert torch.equal(layer(few), kernel.linear(few, kernel.panels(rounded), 40))  # the kernel, fp16 weights
        assert torch.equal(layer(many), (many.double() @ version.double().T).float())  # vLLM's float32 path
        assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, version)  # the version itself kept


@pytest.mark.vllm
def test_vllms_own_packing_in_bfloat16_computes_a_float32_drafter_layer() -> None:
    pytest.importorskip("vllm")
    layer = PackedLinear(torch.zeros(576, 1152))
    tree = nn.Module()
    tree.add_module("proj", layer)
    weight = torch.randn(576, 1152, generator=torch.Generator().manual_seed(0)) * 0.05
    repack = vllm_cpu_repack(torch.bfloat16)
    install(tree, {"proj.weight": weight}, repack)
    x = torch.randn(5, 1152)
    out, expected = layer(x), x @ weight.T
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert torch.allclose(out, expected, rtol=0.03, atol=0.03 * float(expected.abs().max()))


def test_install_in_compiled_mode_keeps_packed_weights_in_the_same_parameter_across_versions() -> None:
    # a stand-in packed layout (the transpose's reverse rows, of the weight's own shape): what counts is
    # that every version is packed before it is copied, into the one parameter a compiled graph holds
    kernel = InPlaceKernel(pack=lambda w: w.flip(0).contiguous(),
                           linear=lambda x, w, n, b: x @ w.flip(0).T, dtypes=(torch.float32,))
    layer = PackedLinear(torch.zeros(3, 4))
    tree = nn.Module()
    tree.add_module("proj", layer)
    x = torch.randn(2, 4)
    first = torch.randn(3, 4)
    install(tree, {"proj.weight": first}, in_place=kernel)
    assert layer.specd_layout == "packed" and torch.equal(layer.weight, first.flip(0))
    weight = layer.weight
    second = torch.randn(3, 4)
    install(tree, {"proj.weight": second}, in_place=kernel)
    assert layer.weight is weight and torch.allclose(layer(x), x @ second.T)


def test_a_prepared_version_is_packed_on_the_preparing_thread_and_only_copied_at_install() -> None:
    packing_threads: list[str] = []

    def pack(weight: torch.Tensor) -> torch.Tensor:
        packing_threads.append(threading.current_thread().name)
        return weight.flip(0).contiguous()

    kernel = InPlaceKernel(pack=pack, linear=lambda x, w, n, b: x @ w.flip(0).T, dtypes=(torch.float32,))
    layer = PackedLinear(torch.zeros(3, 4))
    tree = nn.Module()
    tree.add_module("proj", layer)
    tree.register_parameter("norm", nn.Parameter(torch.ones(4), requires_grad=False))
    install(tree, {"proj.weight": torch.randn(3, 4), "norm": torch.ones(4)}, in_place=kernel)
    new = {"proj.weight": torch.randn(3, 4, dtype=torch.float64), "norm": torch.full((4,), 2.0)}
    prepared: list[Prepared] = []
    swapper = threading.Thread(target=lambda: prepared.append(prepare(tree, new, kernel)), name="swapper")
    swapper.start()
    swapper.join()
    assert packing_threads == ["MainThread", "swapper"]  # the first install's, then the swapper's
    weight = layer.weight
    install(tree, prepared[0], in_place=kernel)
    assert packing_threads == ["MainThread", "swapper"], "install packed the prepared weight again"
    x = torch.randn(2, 4)
    assert layer.weight is weight and torch.allclose(layer(x), x @ new["proj.weight"].float().T)
    assert torch.equal(tree.norm, new["norm"])
    with pytest.raises(CheckpointError, match="shape"):  # a wrong shape is refused before the decoding thread
        prepare(tree, {"proj.weight": torch.randn(5, 4)}, kernel)


def test_install_in_compiled_mode_serves_dtypes_the_kernel_lacks_through_a_plain_matmul() -> None:
    kernel = InPlaceKernel(pack=lambda w: w.flip(0), linear=lambda x, w, n, b: x @ w.flip(0).T)  # bfloat16 only
    layer = PackedLinear(torch.zeros(3, 4))
    tree = nn.Module()
    tree.add_module("proj", layer)
    new = torch.randn(3, 4)
    install(tree, {"proj.weight": new}, in_place=kernel)
    x = torch.randn(2, 4)
    assert layer.specd_layout == "plain" and torch.allclose(layer(x), x @ new.T)


@pytest.mark.vllm
def test_vllms_packed_kernel_computes_the_drafters_linear_layers_after_an_in_place_swap() -> None:
    pytest.importorskip("vllm")
    kernel = vllm_cpu_in_place_kernel()
    if kernel is None:
        pytest.skip("this CPU's vLLM has no packed-weight GEMM: compiled mode serves plain matmuls")
    layer = PackedLinear(torch.zeros(576, 1728, dtype=torch.bfloat16))
    tree = nn.Module()
    tree.add_module("proj", layer)
    x = torch.randn(4, 1728).to(torch.bfloat16)
    for seed in (0, 1):
        weight = torch.randn(576, 1728, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        install(tree, {"proj.weight": weight}, in_place=kernel)
        expected = x.float() @ weight.float().T
        assert torch.allclose(layer(x).float(), expected, rtol=0.02, atol=0.02 * float(expected.abs().max()))
    assert layer.specd_layout == "packed"


def test_vllms_drafter_slot_refuses_a_version_of_another_shape() -> None:
    target = tiny_target().float()
    slot = VllmDrafterSlot(drafter(target), 1, torch.device("cpu"))
    slot.offer(drafter(target, seed=1), 2)
    pending = slot.take()
    assert pending is not None and pending[1] == 2 and set(pending[0][1]) == VLLM_NAMES
    other_layers = new_feature_drafter(target.config, target.embed.weight.float(), target.lm_head.weight.float(),
                                       target.norm.weight.float(), torch.arange(40), capture_layers=(1,))
    with pytest.raises(CheckpointError, match="its own shape"):
        slot.offer(other_layers, 3)
    assert slot.take() is None


def test_plugin_leaves_vllm_alone_without_the_eagle3_route(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.ROUTE_VARIABLE, raising=False)
    plugin.register()  # returns before importing vLLM: a plain vLLM server is untouched
    monkeypatch.setenv(plugin.ROUTE_VARIABLE, "custom")
    plugin.register()


def test_eagle3_route_settings_and_speculative_config() -> None:
    assert PluginSettings.from_env({}).route == "eagle3"
    assert PluginSettings.from_env(PluginSettings(route="custom").to_env()).route == "custom"
    with pytest.raises(ConfigurationError, match="SPECD_ROUTE"):
        PluginSettings.from_env({"SPECD_ROUTE": "medusa"})
    assert speculative_config(3, "eagle3", "/d") == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3,
                                                      "disable_padded_drafter_batch": True,
                                                      "use_local_argmax_reduction": True}
    with pytest.raises(ConfigurationError, match="exported drafter folder"):
        speculative_config(3, "eagle3")


def tiny_target_with_two_versions(tmp_path: Path) -> tuple[Path, Any]:
    """A tiny target checkpoint folder and a store holding two feature drafter versions for it."""
    from specd.hotswap.store import WeightStore
    from specd.model.loading import read_target_head
    from specd.model.target import LoadedTarget
    from specd.testing.processes import tiny_checkpoint

    folder = tiny_checkpoint(tmp_path / "tiny")
    target = LoadedTarget.load(folder).model.float()
    fingerprint = TargetFingerprint.of(read_target_head(folder)[0], folder)
    store = WeightStore(tmp_path / "store")
    for seed in (0, 1):
        store.publish(drafter(target, seed), fingerprint, None, {})
    return folder, store


def test_the_eagle3_route_starts_from_the_stores_live_version_else_the_shipped_drafter(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from specd.model.target import LoadedTarget
    from specd.serving.vllm.shared.launch import prepare_eagle3_drafter
    from specd.testing.processes import free_port

    folder, store = tiny_target_with_two_versions(tmp_path)
    store.set_live(2)
    export = prepare_eagle3_drafter(folder, PluginSettings(store=str(store.root)), tmp_path / "live")
    assert read_metadata(export / SPECD_CHECKPOINT)["specd_version"] == "2"
    export = prepare_eagle3_drafter(folder, PluginSettings(store=str(store.root), version=1), tmp_path / "one")
    assert read_metadata(export / SPECD_CHECKPOINT)["specd_version"] == "1"
    # a learner that cannot be reached: the bundled target starts from the shipped drafter, with a warning
    unreachable = PluginSettings(learner_url=f"http://127.0.0.1:{free_port()}")
    export = prepare_eagle3_drafter(LoadedTarget.load().folder, unreachable, tmp_path / "shipped")
    assert read_metadata(export / SPECD_CHECKPOINT)["specd_version"] == "0"
    assert "shipped drafter" in caplog.text
    with pytest.raises(ConfigurationError, match="cannot start"):  # the shipped drafter is SmolLM2's, not this one's
        prepare_eagle3_drafter(folder, unreachable, tmp_path / "mismatch")


def test_the_eagle3_start_refuses_what_it_cannot_start_from_in_one_line(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    import http.server

    from specd.hotswap.store import WeightStore
    from specd.model.target import LoadedTarget
    from specd.serving.vllm.shared.launch import prepare_eagle3_drafter
    from specd.testing.processes import free_port

    bundled = LoadedTarget.load().folder

    class Garbage(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"[1, 2]")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        garbage = f"http://127.0.0.1:{server.server_address[1]}"
        # a learner answering nonsense: a warning and the shipped drafter, not a traceback
        export = prepare_eagle3_drafter(bundled, PluginSettings(learner_url=garbage), tmp_path / "garbage")
        assert read_metadata(export / SPECD_CHECKPOINT)["specd_version"] == "0" and "JSON object" in caplog.text
        # a version asked for by number is that version or an error, never the shipped drafter instead
        with pytest.raises(ConfigurationError, match="version 3 cannot be fetched"):
            prepare_eagle3_drafter(bundled, PluginSettings(learner_url=garbage, version=3), tmp_path / "three")
    finally:
        server.shutdown()
    with pytest.raises(ConfigurationError, match="version 3 cannot be fetched"):
        prepare_eagle3_drafter(bundled, PluginSettings(learner_url=f"http://127.0.0.1:{free_port()}", version=3),
                               tmp_path / "unreachable")
    a_file = tmp_path / "not-a-store"
    a_file.write_text("")
    with pytest.raises(ConfigurationError, match="is a file"):
        prepare_eagle3_drafter(bundled, PluginSettings(store=str(a_file)), tmp_path / "file")
    store = WeightStore(tmp_path / "store")
    (store.version_dir(1)).mkdir(parents=True)
    (store.version_dir(1) / "manifest.json").write_text(json.dumps({"version": 1, "sha256": "0" * 64}))
    with pytest.raises(ConfigurationError, match="version 1"):
        prepare_eagle3_drafter(bundled, PluginSettings(store=str(store.root), version=1), tmp_path / "missing")


def test_printed_commands_for_different_versions_start_from_folders_of_their_own(tmp_path: Path, capsys,
                                                                                  monkeypatch) -> None:
    from specd.cli.main import main

    folder, store = tiny_target_with_two_versions(tmp_path)
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "cache"))   # where printed commands' exports stay

    def printed(version: int, *flags: str) -> list[str]:
        argv = ["vllm", "--print", "--json", "--target", str(folder), "--store", str(store.root),
                "--version", str(version), *flags]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)["argv"]

    def start_folder(argv: list[str]) -> Path:
        return Path(json.loads(argv[argv.index("--speculative-config") + 1])["model"])

    first, second, again = printed(2), printed(1), printed(2)
    # the first printed command still starts from version 2 after the second was printed
    assert start_folder(first) != start_folder(second) and start_folder(first) == start_folder(again)
    assert read_metadata(start_folder(first) / SPECD_CHECKPOINT)["specd_version"] == "2"
    assert read_metadata(start_folder(second) / SPECD_CHECKPOINT)["specd_version"] == "1"
    # the name `specd serve` answers to (the folder's), and the path vLLM would use
    names = first[first.index("--served-model-name") + 1:first.index("--served-model-name") + 3]
    assert names == ["tiny", str(folder)]
    assert printed(1, "--model-name", "mine")[first.index("--served-model-name") + 1] == "mine"
    own = printed(1, "--", "--served-model-name", "theirs")
    assert own.count("--served-model-name") == 1 and own[own.index("--served-model-name") + 1] == "theirs"
    # the custom route serves token drafters: a store of feature drafters is refused before vLLM starts
    argv = ["vllm", "--print", "--route", "custom", "--target", str(folder), "--store", str(store.root)]
    assert main([*argv, "--version", "1"]) == 2
    assert "version 1 is a feature drafter" in capsys.readouterr().err
