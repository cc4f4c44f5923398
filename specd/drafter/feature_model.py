"""The feature drafter's network: one decoder layer over the target's own hidden states.

Contract: `FeatureDrafterModel` reads, per position t, the target's features at t (the residual
streams after the `capture_layers`, the last of them the target's last layer, concatenated, as
`Transformer.forward(..., capture_layers=...)` returns them) and the embedding of token t + 1,
and predicts token t + 2 over a pruned draft vocabulary (`draft_ids`, target ids, most frequent
first). Its output state stands in for the target's features at t + 1, so drafting k tokens is a
chain of k one-position steps. Serving runs `step` on a static KV cache (the same
overwrite-and-mask cache as the target's); training runs `unrolled` over whole sequences, where
step j sees its own predicted states exactly as draft j does at serving time (EAGLE-3's
training-time test). The target's embedding is borrowed, frozen, and never stored. The layer is
EAGLE-3's exactly as vLLM computes it, so that `specd.drafter.export` can hand any version to
vLLM's native `eagle3` proposer unchanged. Served through specd's few-row kernel, its linear
layers read fp16 copies of their weights (`serve_weights_in_half`): exact for fp16-held weights (the
shipped file), rounded for float32 ones, which changes proposals at most, never served tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from specd.model.fused_layer import FusedLayer, c_positions
from specd.model.packed_linear import PackedLinear, serve_weights_in_half
from specd.model.transformer import MLP, Attention, Block, KVCache, ModelConfig, apply_rope, rope_tables


@dataclass(frozen=True)
class FeatureDrafterConfig:
    """The target's shape (what the drafter reads) and the drafter's own choices."""

    vocab_size: int              # the target's
    hidden_size: int             # the target's: features and embeddings have this width
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    capture_layers: tuple[int, ...]   # target layers whose residual streams are read
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 2048
    rope_llama3: tuple[float, float, float, int] | None = None
    num_layers: int = 1          # decoder layers: EAGLE-3 has one; vLLM's eagle3 loads more

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                 "draft_vocab_size", "max_position", "num_layers")
        if not all(type(getattr(self, name)) is int for name in sizes):  # a config read from a file
            raise ValueError(f"{', '.join(sizes)} must be integers")
        if self.num_layers < 1:
            raise ValueError(f"a feature drafter has at least one decoder layer, got num_layers {self.num_layers}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in (0, {self.vocab_size}], got {self.draft_vocab_size}")
        if not self.capture_layers:
            raise ValueError("a feature drafter reads at least one target layer")
        # the target captures each layer once, in layer order: a repeated, negative or out-of-order
        # index would give features of another width or order than the drafter reads
        if not all(type(layer) is int and layer >= 0 for layer in self.capture_layers) \
                or len(set(self.capture_layers)) != len(self.capture_layers) \
                or list(self.capture_layers) != sorted(self.capture_layers):
            raise ValueError(f"capture_layers must be distinct non-negative layer indices in increasing order, "
                             f"got {self.capture_layers}")

    @property
    def feature_size(self) -> int:
        return len(self.capture_layers) * self.hidden_size

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int,
                   capture_layers: tuple[int, ...] | None = None, num_layers: int = 1) -> FeatureDrafterConfig:
        """Low, middle and high layers as in EAGLE-3 plus the last one, and a decoder layer shaped like
        the target's. The last layer must be among them: it carries the target's own next-token
        distribution, which is the learner's label and the day-0 drafter's starting point."""
        layers = target.num_layers
        if capture_layers is None:
            capture_layers = tuple(sorted({min(2, layers - 1), layers // 2, max(layers - 3, 0), layers - 1}))
        if capture_layers[-1] != layers - 1:
            raise ValueError(f"a feature drafter must read the target's last layer ({layers - 1}), "
                             f"got capture_layers {tuple(capture_layers)}")
        return cls(target.vocab_size, target.hidden_size, target.num_heads, target.num_kv_heads, target.head_dim,
                   target.intermediate_size, tuple(capture_layers), min(draft_vocab_size, target.vocab_size),
                   target.rms_norm_eps, target.rope_theta, target.max_position, target.rope_llama3, num_layers)

    def layer_config(self) -> ModelConfig:
        """The decoder layers' shape (and the KV cache's: one entry per layer)."""
        return ModelConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           max_position=self.max_position, rope_llama3=self.rope_llama3)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> FeatureDrafterConfig:
        fields = dict(raw)
        fields["capture_layers"] = tuple(fields["capture_layers"])
        if fields.get("rope_llama3") is not None:
            fields["rope_llama3"] = tuple(fields["rope_llama3"])
        return cls(**fields)


class FeatureDrafterModel(nn.Module):
    """EAGLE-3's drafter exactly as vLLM computes it (`Eagle3LlamaForCausalLM`, one layer).

    state s = fc([fc_norm_i(feature chunk i)]); one step reads s and the next token's embedding e:
    a = attention over qkv([input_norm(e), hidden_norm(s)]) (twice the width), r = s + a,
    out = r + mlp(post_norm(r)); logits = head(norm(out)); `out` is the next step's state.
    With `num_layers` > 1, each further layer is a plain pre-norm Llama layer on `out`
    (`deeper_layers`), as vLLM stacks them after the first.
    """

    draft_ids: torch.Tensor   # [draft_vocab_size] target ids, a buffer stored with the weights
    embedding: torch.Tensor   # the target's, a non-persistent buffer

    def __init__(self, config: FeatureDrafterConfig, embedding: torch.Tensor,
                 draft_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        if tuple(embedding.shape) != (config.vocab_size, hidden):
            raise ValueError(f"the target's embedding is {tuple(embedding.shape)}, "
                             f"the drafter expects {(config.vocab_size, hidden)}")
        layer = config.layer_config()
        # each layer's residual stream has its own scale (deep ones run to hundreds): every chunk
        # gets its own RMS norm before the fusion so that no layer drowns the others
        self.fc_norms = nn.ModuleList(nn.RMSNorm(hidden, eps=config.rms_norm_eps)
                                      for _ in config.capture_layers)
        self.fc = PackedLinear(config.feature_size, hidden, bias=False)
        self.input_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.attn = Attention(layer, input_size=2 * hidden)
        self.post_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.mlp = MLP(layer)
        self.deeper_layers = nn.ModuleList(Block(layer) for _ in range(config.num_layers - 1))
        self.norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.head = PackedLinear(hidden, config.draft_vocab_size, bias=False)
        if draft_ids is None:
            draft_ids = torch.arange(config.draft_vocab_size)
        self.register_buffer("draft_ids", draft_ids.to(torch.long).clone())
        # borrowed from the target and frozen: not a parameter, not in the state dict
        self.register_buffer("embedding", embedding.detach(), persistent=False)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fused = FusedLayer((self.input_norm, self.hidden_norm), self.attn, self.post_norm, self.mlp)
        # its products only propose drafts: the few-row kernel may read its weights in fp16, half
        # the bytes a drafting step streams (the shipped file is fp16: the same products as float32)
        serve_weights_in_half(self)

    @property
    def deeper(self) -> list[Block]:
        """The layers after EAGLE-3's first (none by default)."""
        return cast(list[Block], self.deeper_layers)

    def clone(self) -> FeatureDrafterModel:
        """A copy of the weights that shares the (frozen, large) target embedding."""
        twin = FeatureDrafterModel(self.config, self.embedding, self.draft_ids)
        twin.load_state_dict(self.state_dict())
        return twin.to(self.head.weight.dtype).train(self.training)

    # ---- pieces shared by serving and training --------------------------------------------
    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [.., feature_size] to the drafter's state width [.., hidden]."""
        chunks = features.to(self.fc.weight.dtype).split(self.config.hidden_size, dim=-1)
        return self.fc(torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norms, chunks, strict=True)], dim=-1))

    def _layer_input(self, state: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        embedded = F.embedding(next_tokens, self.embedding).to(state.dtype)
        return torch.cat([self.input_norm(embedded), self.hidden_norm(state)], dim=-1)

    def _finish(self, state: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output state from its input state and the attention's output."""
        residual = state + attended
        return residual + self.mlp(self.post_norm(residual))

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of output states."""
        return self.head(self.norm(state))

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.head.weight.device
        if self._rope is None or self._rope[0].shape[0] < length or self._rope[0].device != device:
            self._rope = rope_tables(self.config.layer_config(), max(length, self.config.max_position), device)
        return self._rope

    def new_cache(self, max_batch: int, max_seq: int) -> KVCache:
        weight = self.head.weight
        return KVCache(self.config.layer_config(), max_batch, max_seq, weight.dtype, weight.device)

    # ---- serving --------------------------------------------------------------------------
    def step(self, state: torch.Tensor, next_tokens: torch.Tensor, start: torch.Tensor, cache: KVCache,
             first_slot: int = 0) -> torch.Tensor:
        """Positions start[b]..start[b]+T-1 of rows in slots first_slot..: state [B, T, hidden] (fused
        target features or the drafter's own output states), next_tokens [B, T]. Returns output states."""
        batch, length = next_tokens.shape
        positions = start[:, None] + torch.arange(length, device=next_tokens.device)
        rope = self.rope(cache.max_seq)
        slots = slice(first_slot, first_slot + batch)
        where = c_positions(positions, cache.max_seq, rope) if not self.deeper else None
        if where is not None:  # EAGLE-3's single layer: one call of the kernel's library where it serves
            out = self._fused(state, where, cache.k[0, slots], cache.v[0, slots], rope, self.embedding, next_tokens)
            if out is not None:
                return out
        cos, sin = rope[0][positions][:, None], rope[1][positions][:, None]
        kv_len = int(start.max()) + length
        mask = None
        if length > 1 or batch > 1:
            mask = (torch.arange(kv_len, device=positions.device) <= positions[:, :, None])[:, None]
        write_index = torch.arange(batch, device=next_tokens.device)[:, None]
        attended = self.attn(self._layer_input(state, next_tokens), cos, sin, write_index, positions,
                             cache.k[0, slots], cache.v[0, slots], mask)
        out = self._finish(state, attended)
        for index, block in enumerate(self.deeper, start=1):
            out = out + block.attn(block.attn_norm(out), cos, sin, write_index, positions,
                                   cache.k[index, slots], cache.v[index, slots], mask)
            out = out + block.mlp(block.mlp_norm(out))
        return out

    # ---- training -------------------------------------------------------------------------
    def unrolled(self, features: torch.Tensor, next_tokens: torch.Tensor, steps: int,
                 start: int = 0) -> list[torch.Tensor]:
        """Output states of `steps` chained drafting steps over whole sequences.

        features [B, T, feature_size] are the target's at positions 0..T-1; next_tokens[:, t] is
        token t + 1. Step j (0-based) at position t is the j+1-th draft made after the target's
        features at t - j: it reads its own step j-1 state from position t - 1 and attends to the
        target-fed entries at positions <= t - j plus its own chain (one entry per earlier step).
        Its output predicts token t + 2 for every j. Positions t < j have no such chain; their
        outputs are meaningless and must be masked out of any loss.

        Each output is [B, T - start, hidden], positions start..T-1: step 0's keys cover every
        position (a query attends to all target-fed entries before it), but queries, chains and the
        MLP run from `start` on only, so a replay that reads no prompt position skips their cost.
        Step j's output at position t is the same for any start <= t - j. With deeper layers every
        step runs over all positions (their step-0 keys are the first layer's outputs everywhere),
        and the outputs are cut to the window at the end.
        """
        if self.deeper_layers and start:
            return [out[:, start:] for out in self.unrolled(features, next_tokens, steps)]
        cfg = self.config
        batch, length, _ = features.shape
        width = length - start
        positions = torch.arange(length, device=features.device)
        cos_table, sin_table = self.rope(length)
        cos, sin = cos_table[positions][None, None], sin_table[positions][None, None]
        window_rope = cos[..., start:, :], sin[..., start:, :]
        attn, scale = self.attn, 1.0 / math.sqrt(cfg.head_dim)
        tokens = next_tokens[:, start:]
        state = self.fuse_features(features)
        # per layer, one key and value entry per chain step
        keys: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_layers)]
        values: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_layers)]
        outputs: list[torch.Tensor] = []
        for j in range(steps):
            if j > 0:  # this step's state at t is the previous step's output at t - 1
                state = F.pad(outputs[-1][:, :-1], (0, 0, 1, 0))
            wide = j == 0  # step 0's keys and values span every position; its queries only the window
            q, k, v = attn.qkv(self._layer_input(state, next_tokens if wide else tokens)).split(attn.split, dim=-1)
            keys[0].append(self._heads(k, (cos, sin) if wide else window_rope))  # [B, H, span, D]
            values[0].append(self._heads(v))
            if wide:
                q, state = q[:, start:], state[:, start:]
            # target-fed entries (step 0's keys) at positions <= t - j
            visible = positions[None, :] <= positions[start:, None] - j  # [width (query), T (key)]
            out = _chained_attention(self._heads(q, window_rope), keys[0], values[0], visible, scale)
            hidden = self._finish(state, attn.o(out.transpose(1, 2).reshape(batch, width, -1)))
            outputs.append(self._deeper_chain_step(hidden, keys, values, visible, window_rope, scale))
        return outputs

    def _heads(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """[B, W, heads * D] -> [B, H, W, D]: rotated when `rope` is given, key and value heads
        repeated to the query heads they serve."""
        cfg = self.config
        count = x.shape[-1] // cfg.head_dim
        x = x.reshape(x.shape[0], x.shape[1], count, cfg.head_dim).transpose(1, 2)
        x = apply_rope(x, *rope) if rope is not None else x
        return x if count == cfg.num_heads else x.repeat_interleave(cfg.num_heads // count, dim=1)

    def _deeper_chain_step(self, hidden: torch.Tensor, keys: list[list[torch.Tensor]],
                           values: list[list[torch.Tensor]], visible: torch.Tensor,
                           rope: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
        """One chain step of `unrolled` through the layers after the first (over every position:
        `unrolled` runs them from start 0), each with its own chain of keys and values."""
        for index, block in enumerate(self.deeper, start=1):
            q, k, v = block.attn.qkv(block.attn_norm(hidden)).split(block.attn.split, dim=-1)
            keys[index].append(self._heads(k, rope))
            values[index].append(self._heads(v))
            out = _chained_attention(self._heads(q, rope), keys[index], values[index], visible, scale)
            hidden = hidden + block.attn.o(out.transpose(1, 2).flatten(2))
            hidden = hidden + block.mlp(block.mlp_norm(hidden))
        return hidden


def _chained_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                       visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Step j = len(keys) - 1 of `unrolled`: queries [B, H, W, D] attend to the target-fed entries
    (keys[0] over every position, where `visible`) and to the chain, step i's entry at position
    t - (j - i) (keys[i] over the window), one score per query."""
    j, width, length = len(keys) - 1, q.shape[2], keys[0].shape[2]
    scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))]
    chain_values = []
    for i in range(1, j + 1):
        shift = j - i
        if shift >= width:  # a chain longer than the window: every entry is before its start, padding
            k_i, v_i = torch.zeros_like(keys[i]), torch.zeros_like(values[i])
        else:
            k_i = F.pad(keys[i][:, :, :width - shift], (0, 0, shift, 0)) if shift else keys[i]
            v_i = F.pad(values[i][:, :, :width - shift], (0, 0, shift, 0)) if shift else values[i]
        scores.append((q * k_i).sum(-1, keepdim=True) * scale)
        chain_values.append(v_i)
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = weights[..., :length] @ values[0]
    for i, v_i in enumerate(chain_values):
        out = out + weights[..., length + i:length + i + 1] * v_i
    return out

def new_feature_drafter(target_config: ModelConfig, embedding: torch.Tensor, lm_head: torch.Tensor,
                        final_norm: torch.Tensor, draft_ids: torch.Tensor,
                        capture_layers: tuple[int, ...] | None = None, seed: int = 0,
                        num_layers: int = 1) -> FeatureDrafterModel:
    """A day-0 feature drafter: near-identity fusion, quiet random layers, the target's output rows."""
    config = FeatureDrafterConfig.for_target(target_config, len(draft_ids), capture_layers, num_layers)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = FeatureDrafterModel(config, embedding.float().cpu(), draft_ids.cpu())
        for param in model.parameters():
            if param.dim() > 1:
                nn.init.normal_(param, std=0.02)
        hidden = config.hidden_size
        norm_weight = final_norm.detach().float().cpu()
        with torch.no_grad():
            # start as "the target's own last state": the fusion passes the last layer's residual
            # stream through (its chunk norm times the output norm's weight is the target's final
            # norm), the layer adds little, and the output rows are the target's, so day 0
            # predicts the target's next-token distribution one position early instead of noise,
            # and training bends it forward from there
            model.fc.weight.mul_(0.1)
            model.fc.weight[:, -hidden:] += torch.eye(hidden)
            model.attn.o.weight.mul_(0.1)
            model.mlp.down.weight.mul_(0.1)
            for block in model.deeper:
                block.attn.o.weight.mul_(0.1)
                block.mlp.down.weight.mul_(0.1)
            model.head.weight.copy_(lm_head.detach().float().cpu()[draft_ids.cpu()])
            model.norm.weight.copy_(norm_weight)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()


def init_from_target_layer(model: FeatureDrafterModel, block: Block, damping: float = 0.1) -> FeatureDrafterModel:
    """Start the drafter's (first) decoder layer from a target layer's weights, in place: the state
    half of its attention input, its attention and its MLP take `block`'s (the target's last layer:
    the state starts as that layer's residual stream), with the two output projections scaled by
    `damping`, so that day 0 stays near what `new_feature_drafter` predicts while training starts
    from the target's own attention and MLP features instead of noise. The embedding half of the
    attention input stays as it was."""
    hidden = model.config.hidden_size
    attn, source = model.attn, block.attn
    if tuple(source.qkv.weight.shape) != (attn.qkv.weight.shape[0], hidden) \
            or tuple(block.mlp.gate_up.weight.shape) != tuple(model.mlp.gate_up.weight.shape):
        raise ValueError("the target layer's shape differs from the drafter's layer")
    with torch.no_grad():
        attn.qkv.weight[:, hidden:].copy_(source.qkv.weight.float())
        if attn.qkv.bias is not None and source.qkv.bias is not None:
            attn.qkv.bias.copy_(source.qkv.bias.float())
        model.hidden_norm.weight.copy_(block.attn_norm.weight.float())
        attn.o.weight.copy_(source.o.weight.float() * damping)
        model.post_norm.weight.copy_(block.mlp_norm.weight.float())
        model.mlp.gate_up.weight.copy_(block.mlp.gate_up.weight.float())
        model.mlp.down.weight.copy_(block.mlp.down.weight.float() * damping)
    return model
