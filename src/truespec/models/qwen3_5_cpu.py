"""The CPU path of a Qwen3.5 decoder layer through compiled calls: a GDN layer whole (cpu_kernels/gdn_layer.py), an
attention layer whole (cpu_kernels/attention_layer.py), else its post-attention norm and
MLP (cpu_kernels/mlp_block.py). Each call is built once per layer and kept while the tensors it reads stay the same
objects, storage and versions (cpu_kernels/build.tensor_key). Whether a layer takes a call depends on its weights,
dtype and cache, never on what else is in the step (a row's bits must not depend on the rest of its batch); a whole
call and the stages run the same C function per stage. None from any function: the stage-by-stage path.
"""

from collections.abc import Callable

import torch
from torch import nn

from truespec.cpu_kernels import attention_layer as cpu_attention_layer
from truespec.cpu_kernels import build
from truespec.cpu_kernels import decoder_stack as cpu_decoder_stack
from truespec.cpu_kernels import gdn_layer as cpu_gdn_layer
from truespec.cpu_kernels import mlp_block as cpu_mlp_block
from truespec.forward_context import get_forward_context

Owners = list[tuple[nn.Module, str]]  # (module, parameter name) of the weights a call reads, in its key's order


class KeptCalls:
    """One decoder layer's kept compiled calls, by name, each with the key of the tensors it was built from."""

    def __init__(self) -> None:
        self._sources: dict[str, list[tuple[dict, str]]] = {}  # each weight's parameter dict: no __getattr__ per step
        self._calls: dict[str, tuple[tuple, object | None]] = {}

    def get(self, name: str, owners: Callable[[], Owners], states: list[torch.Tensor],
            make: Callable[[], object | None]) -> object | None:  # fmt: skip
        """The call kept under ``name``, rebuilt by ``make`` (None: the layer cannot take it) when its tensors moved;
        None for weights without a version counter (inference tensors)."""
        sources = self._sources.get(name)
        if sources is None:
            sources = self._sources[name] = [(m._parameters, param) for m, param in owners()]
        key = build.tensor_key([params[param] for params, param in sources], states)
        if key is None:
            return None
        kept = self._calls.get(name)
        if kept is None or kept[0] != key:
            kept = self._calls[name] = (key, make())
        return kept[1]

    def kept(self, name: str) -> object | None:
        """The call now kept under ``name`` (tests)."""
        return self._calls[name][1] if name in self._calls else None


def gdn_layer(layer: nn.Module, h: torch.Tensor,
              residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """A GDN decoder layer's (MLP output, residual) in one call, where its kernels take every stage."""
    if residual is not None and (residual.shape != h.shape or residual.dtype != h.dtype):
        return None
    if (call := _gdn_call(layer, h)) is None:
        return None
    ctx = get_forward_context()
    return call(h, residual, (ctx.query_start_loc, ctx.state_src, ctx.state_dst, ctx.state_write_start))


def attention_layer(layer: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """A gated-attention decoder layer's (MLP output, residual) in one call, for a step over a model-dtype cache, where
    its kernels take every stage."""
    if residual is not None and (residual.shape != h.shape or residual.dtype != h.dtype) or cos.dtype != h.dtype:
        return None
    ctx = get_forward_context()
    if (call := _attention_call(layer, h)) is None:
        return None
    return call(h, residual, cos, sin, (ctx.block_tables, ctx.query_start_loc, ctx.seq_lens, ctx.slot_mapping))


class KeptStack:
    """A model's kept ``DecoderStackCall`` with one key for all it was built from (every layer's weights and states,
    the switches its layers' calls read): a step whose key is unchanged reuses it without asking each layer."""

    def __init__(self) -> None:
        self.stack: cpu_decoder_stack.DecoderStackCall | None = None
        self._key: tuple | None = None
        self._sources: list[tuple[dict, str]] | None = None  # every layer's weights, as KeptCalls keeps them
        self._gdns: list[nn.Module] = []  # the GatedDeltaNet modules (their states), in layer order
        self._attns: list[nn.Module] = []  # the PagedAttention modules (their caches)

    def key(self, model: nn.Module, h: torch.Tensor) -> tuple:
        """What the stack's layer calls depend on: ~25 us for the embedded model's 12 layers (the per-layer checks it
        replaces cost ~10 us a layer)."""
        if self._sources is None:
            layers = list(model.layers)
            self._gdns = [layer.linear_attn for layer in layers if layer.layer_type == "linear_attention"]
            self._attns = [layer.self_attn.attn for layer in layers if layer.layer_type != "linear_attention"]
            owners = [_gdn_owners(layer) if layer.layer_type == "linear_attention" else _attention_owners(layer)
                      for layer in layers]  # fmt: skip
            self._sources = [(m._parameters, param) for layer_owners in owners for m, param in layer_owners]
            self._sources.append((model.norm._parameters, "weight"))
        weights = [params[param] for params, param in self._sources]
        states = [t for g in self._gdns for t in (g.conv_state, g.ssm_state)] + [a.kv_cache for a in self._attns]
        if any(t is None for t in states):
            return ()
        settings = (cpu_gdn_layer.ENABLED, cpu_attention_layer.ENABLED, h.dtype,
                    bool(self._gdns) and self._gdns[0].takes_kernels(h),
                    all(a.kv_format is None and a.sparse_v is None for a in self._attns))  # fmt: skip
        try:
            return settings, build.storage_key(weights, states)
        except RuntimeError:  # an inference-tensor weight has no version: its layer keeps the stages (KeptCalls)
            return ()

    def get(self, key: tuple, calls: Callable[[], list | None],
            norm: nn.Module) -> cpu_decoder_stack.DecoderStackCall | None:  # fmt: skip
        """The kept stack if ``key`` is its key, else one over ``calls()`` and the final ``norm`` (None: some layer
        cannot take its call)."""
        if key != self._key or self.stack is None:
            layer_calls = calls()
            if layer_calls is None:
                return None
            self.stack = cpu_decoder_stack.DecoderStackCall(layer_calls, norm.weight, norm.eps, norm.unit_offset)
            self._key = key
        return self.stack


def decoder_stack(model: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """The model's hidden states (every decoder layer, then its final norm) in one call, where each layer takes its
    whole call this step; None: one call (or the stages) per layer."""
    ctx = get_forward_context()
    num_reqs = ctx.query_start_loc.shape[0] - 1
    if not cpu_decoder_stack.ENABLED or h.dim() != 2 or cos.dtype != h.dtype \
            or ctx.state_src.shape[0] != num_reqs or ctx.seq_lens.shape[0] != num_reqs:
        return None
    stack = model.cpu_stack.get(model.cpu_stack.key(model, h), lambda: _layer_calls(model, h), model.norm)
    if stack is None or torch.is_grad_enabled() and build.tracks_grad(h, *(t for c in stack.calls for t in c.tensors)):
        return None
    return stack(h, cos, sin, (ctx.query_start_loc, ctx.state_src, ctx.state_dst, ctx.state_write_start),
                 (ctx.block_tables, ctx.seq_lens, ctx.slot_mapping))  # fmt: skip


def _layer_calls(model: nn.Module, h: torch.Tensor) -> list | None:
    """Each layer's kept call for this step, in layer order; None if some layer cannot take its call."""
    calls = []
    for layer in model.layers:
        is_linear = layer.layer_type == "linear_attention"
        call = _gdn_call(layer, h) if is_linear else _attention_call(layer, h)
        if call is None:
            return None
        calls.append(call)
    return calls


def _gdn_call(layer: nn.Module, h: torch.Tensor) -> cpu_gdn_layer.GdnLayerCall | None:
    """The GDN layer's kept call for rows like h, or None (the stages)."""
    gdn = layer.linear_attn
    states = [gdn.conv_state, gdn.ssm_state]
    if not cpu_gdn_layer.ENABLED or states[0] is None or states[1] is None or h.dim() != 2 or gdn.takes_kernels(h):
        return None
    call = layer.cpu_calls.get("gdn_layer", lambda: _gdn_owners(layer), states,
                               lambda: _make_gdn_call(layer, h, states))  # fmt: skip
    return None if call is None or h.dtype != call.dtype or build.tracks_grad(h, *call.tensors) else call


def _attention_call(layer: nn.Module, h: torch.Tensor) -> cpu_attention_layer.AttentionLayerCall | None:
    """The attention layer's kept call for rows like h, or None."""
    attn = layer.self_attn.attn
    if not cpu_attention_layer.ENABLED or attn.kv_cache is None or attn.kv_format is not None \
            or attn.sparse_v is not None or h.dim() != 2:
        return None
    call = layer.cpu_calls.get("attention_layer", lambda: _attention_owners(layer), [attn.kv_cache],
                               lambda: _make_attention_call(layer, h, attn.kv_cache))  # fmt: skip
    return None if call is None or h.dtype != call.dtype or build.tracks_grad(h, *call.tensors) else call


def mlp_block(layer: nn.Module, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The post-attention add + RMSNorm and the MLP's (output, residual) in one call, where the kernels take them."""
    if not cpu_mlp_block.ENABLED or h.dim() != 2 or residual.shape != h.shape or residual.dtype != h.dtype:
        return None
    call = layer.cpu_calls.get("mlp_block", lambda: _mlp_owners(layer), [], lambda: _make_mlp_call(layer, h))
    if call is None or h.dtype != call.dtype or build.tracks_grad(h, *call.tensors):
        return None
    return call(h, residual)


def _gdn_owners(layer: nn.Module) -> Owners:
    gdn, mlp = layer.linear_attn, layer.mlp
    vectors = [(layer.input_layernorm, "weight"), (layer.post_attention_layernorm, "weight"), (gdn.conv1d, "weight"),
               (gdn, "A_log"), (gdn, "dt_bias"), (gdn.norm, "weight")]  # fmt: skip
    return vectors + [(m, "weight") for m in (gdn.in_proj, gdn.out_proj, mlp.gate_up_proj, mlp.down_proj)]


def _attention_owners(layer: nn.Module) -> Owners:
    attn, mlp = layer.self_attn, layer.mlp
    vectors = [(layer.input_layernorm, "weight"), (layer.post_attention_layernorm, "weight"),
               (attn.q_norm, "weight"), (attn.k_norm, "weight")]  # fmt: skip
    return vectors + [(m, "weight") for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]


def _mlp_owners(layer: nn.Module) -> Owners:
    mlp = layer.mlp
    return [(layer.post_attention_layernorm, "weight"), (mlp.gate_up_proj, "weight"), (mlp.down_proj, "weight")]


def _make_gdn_call(layer: nn.Module, h: torch.Tensor,
                   states: list[torch.Tensor]) -> cpu_gdn_layer.GdnLayerCall | None:  # fmt: skip
    gdn, mlp = layer.linear_attn, layer.mlp
    projections = (gdn.in_proj, gdn.out_proj, mlp.gate_up_proj, mlp.down_proj)
    if gdn.hidden_act != "silu" or mlp.hidden_act != "silu" or any(m.bias is not None for m in projections):
        return None
    norm, post = layer.input_layernorm, layer.post_attention_layernorm
    w = cpu_gdn_layer.GdnLayerWeights(
        norm.weight, norm.eps, norm.unit_offset, post.weight, post.eps, post.unit_offset,
        *(m.weight for m in projections), gdn.conv1d.weight, gdn.A_log, gdn.dt_bias, gdn.norm.weight, gdn.norm.eps,
        (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim))  # fmt: skip
    with torch.no_grad():  # whether the weights can take it; autograd is asked per call
        if not cpu_gdn_layer.can_run(h, w, *states):
            return None
    return cpu_gdn_layer.GdnLayerCall(w, *states)


def _make_attention_call(layer: nn.Module, h: torch.Tensor,
                         kv_cache: torch.Tensor) -> cpu_attention_layer.AttentionLayerCall | None:  # fmt: skip
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    q_norm, k_norm = attn.q_norm, attn.k_norm
    if mlp.hidden_act != "silu" or any(m.bias is not None for m in projections) \
            or (q_norm.eps, q_norm.unit_offset) != (k_norm.eps, k_norm.unit_offset):
        return None
    norm, post = layer.input_layernorm, layer.post_attention_layernorm
    w = cpu_attention_layer.AttentionLayerWeights(
        norm.weight, norm.eps, norm.unit_offset, post.weight, post.eps, post.unit_offset,
        *(m.weight for m in projections), q_norm.weight, k_norm.weight, q_norm.eps, q_norm.unit_offset,
        (attn.num_heads, attn.num_kv_heads, attn.head_dim), attn.attn.scale)  # fmt: skip
    with torch.no_grad():  # whether the weights can take it; autograd is asked per call
        if not cpu_attention_layer.can_run(h, w, kv_cache):
            return None
    return cpu_attention_layer.AttentionLayerCall(w, kv_cache)


def _make_mlp_call(layer: nn.Module, h: torch.Tensor) -> cpu_mlp_block.MlpBlockCall | None:
    mlp, post = layer.mlp, layer.post_attention_layernorm
    if mlp.hidden_act != "silu" or any(m.bias is not None for m in (mlp.gate_up_proj, mlp.down_proj)):
        return None
    with torch.no_grad():  # whether the weights can take it; autograd is asked per call
        if not cpu_mlp_block.can_run(h, post.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight):
            return None
    return cpu_mlp_block.MlpBlockCall(post.weight, post.eps, post.unit_offset, mlp.gate_up_proj.weight,
                                      mlp.down_proj.weight)  # fmt: skip
