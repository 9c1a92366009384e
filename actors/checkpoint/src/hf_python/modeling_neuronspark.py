"""NeuronSpark spiking language model for Hugging Face `transformers`, pure PyTorch.

Written for nsactor from the model's specification (nsactor's SPEC and its Rust model, the
source of truth); it is not derived from the authors' code. It is a reference implementation:
every PLIF neuron is a sequential scan over the frames in a Python loop, and clarity wins over
speed. No Triton or CUDA-only code: it runs on the CPU and on any GPU, in float32.

The network, per token t of the input (K SNN frames per token, frame index t*K + k):
  * encode: h_t = E[id_t] (no scaling, no positions); the K frames of a token share h_t.
  * each decoder layer, twice (SNN block, then SNN FFN): RMSNorm(h_t), an input PLIF neuron
    driven by (1 - beta) * x for K frames, the sublayer over the frames, PonderNet-style
    aggregation of its K outputs (geometric halting normalised by its sum), then
    h_t += centred(out_proj(agg)).
  * decode: RMSNorm, the output PLIF neuron over K frames, the mean of its K outputs,
    decode_proj, LateralInhibition (an RMS normalisation with a gain), the tied head E^T.
A PLIF neuron: v_pre = beta * v + u (one rounding, as a fused multiply-add), spike =
[v_pre >= v_th], v = v_pre - v_th * spike (soft reset). Every neuron passes on its membrane
potential (never its spikes): the SNN block's hidden neurons V_post, the others
(1 - beta) * V_post ("leak") or V_post, as `config.nsactor_plif_out` says. The reset treats the
spike as a constant, so autograd gives the reference's gradients (the surrogate never enters).

The model is recurrent: its whole decoding state is the neurons' membrane potentials, a
constant size whatever the context (`NeuronSparkState`). `forward(input_ids, state=...)` goes
on from a state and returns the new one; `generate` carries it between steps, feeding only the
new token; `step` decodes one token.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_neuronspark import NeuronSparkConfig

try:  # transformers >= 5: initialisers that leave loaded weights alone
    from transformers import initialization as init
except ImportError:  # pragma: no cover
    from torch.nn import init

RMS_EPS = 1e-6
LATERAL_EPS = 1e-6
HALT_CLAMP = 1e-7  # halting probabilities are clamped to [HALT_CLAMP, 1 - HALT_CLAMP]
HALT_NORM_EPS = 1e-8  # lambda_hat = lambda / (sum(lambda) + HALT_NORM_EPS)
HALT_BIAS = -3.5
INPUT_V_THRESHOLD, FFN_V_THRESHOLD, OUTPUT_V_THRESHOLD = 0.5, 0.15, 0.3


def _sigmoid(x):
    """sigma(x) as exp(-log(1 + e^-x)): the formula nsactor's CPU backend uses (a few ulp off
    torch.sigmoid); it only matters where a membrane potential sits on its threshold."""
    return torch.exp(-torch.log(torch.exp(-x) + 1.0))


def _softplus(x):
    """softplus(x) = max(x, 0) + log1p(e^-|x|) (overflow-free, no threshold)."""
    return x.clamp_min(0.0) + torch.log1p(torch.exp(-x.abs()))


def plif_scan(beta, u, v_th, v0):
    """The exact sequential PLIF scan. `u` [S, B, C]: input current of S frames; `beta`, `v_th`:
    [S, B, C] per frame, or broadcastable to [B, C] (held for every frame); `v0` [B, C].
    Returns V_post [S, B, C]. `beta * v + u` is rounded once (a fused multiply-add, computed
    in float64: the product of two float32 is exact there), as the reference kernels do."""
    per_frame = beta.dim() == u.dim()
    wide = torch.float32 if u.device.type == "mps" else torch.float64
    beta_w, u_w = beta.to(wide), u.to(wide)
    v = v0.to(u.dtype)
    out = []
    for s in range(u.shape[0]):
        b = beta_w[s] if per_frame else beta_w
        th = v_th[s] if per_frame else v_th
        v_pre = (b * v.to(wide) + u_w[s]).to(u.dtype)
        spike = (v_pre >= th).to(u.dtype).detach()
        v = v_pre - th * spike
        out.append(v)
    return torch.stack(out, 0)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) over the last dimension."""

    def __init__(self, dim, eps=RMS_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * (1.0 / torch.sqrt(x.square().mean(-1, keepdim=True) + self.eps)) * self.weight


class LateralInhibition(nn.Module):
    """Divisive normalisation with a learnable gain (RMSNorm-equivalent)."""

    def __init__(self, dim, eps=LATERAL_EPS):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, y):
        return y * (1.0 / torch.sqrt(y.square().mean(-1, keepdim=True) + self.eps)) * self.gain


class PLIFNode(nn.Module):
    """PLIF neuron with a learnable decay beta = sigma(w) and threshold v_th per channel."""

    def __init__(self, dim, v_threshold):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(dim))
        self.v_th = nn.Parameter(torch.full((dim,), float(v_threshold)))
        self.v_threshold = v_threshold  # the init's base threshold

    def forward_tokens(self, x, K, v0, plif_out):
        """`x` [T, B, C] per token, driving u = (1 - beta) * x for K frames each, from state
        `v0` [B, C]: the output [T*K, B, C] and the last membrane potential [B, C]."""
        beta = _sigmoid(self.w)
        one_minus = 1.0 - beta
        u = (x * one_minus).repeat_interleave(K, dim=0)
        vpost = plif_scan(beta, u, self.v_th, v0)
        y = vpost * one_minus if plif_out == "leak" else vpost
        return y, vpost[-1].detach()


class SNNBlock(nn.Module):
    """Seven projections, selective modulation (beta, alpha, V_th from the input) and the
    hidden neurons' per-element PLIF scan; output W_out V_post * sigma(W_gate a) + W_skip a."""

    def __init__(self, D, N):
        super().__init__()
        DN = D * N
        self.b_beta = nn.Parameter(torch.zeros(DN))
        self.b_alpha = nn.Parameter(torch.zeros(DN))
        self.b_th = nn.Parameter(torch.zeros(DN))
        for name in ("W_in", "W_beta_x", "W_alpha_x", "W_th_x"):
            setattr(self, name, nn.Linear(D, DN, bias=False))
        self.W_gate = nn.Linear(D, D, bias=False)
        self.W_skip = nn.Linear(D, D, bias=False)
        self.W_out = nn.Linear(DN, D, bias=False)
        self.N = N

    def forward(self, a, v0, v_th_min):
        i = self.W_in(a)
        beta = _sigmoid(self.W_beta_x(a) + self.b_beta)
        alpha = _softplus(self.W_alpha_x(a) + self.b_alpha)
        v_th = (self.W_th_x(a) + self.b_th).abs() + v_th_min
        vpost = plif_scan(beta, alpha * i, v_th, v0)
        out = self.W_out(vpost) * _sigmoid(self.W_gate(a)) + self.W_skip(a)
        return out, vpost[-1].detach()


class SNNFFN(nn.Module):
    """Gate and up projections, their PLIF neurons (one merged row-parameter scan, gate first),
    the product of their outputs, the down projection plus a skip path."""

    def __init__(self, D, D_ff):
        super().__init__()
        self.gate_proj = nn.Linear(D, D_ff, bias=False)
        self.up_proj = nn.Linear(D, D_ff, bias=False)
        self.down_proj = nn.Linear(D_ff, D, bias=False)
        self.skip_proj = nn.Linear(D, D, bias=False)
        self.gate_neuron = PLIFNode(D_ff, FFN_V_THRESHOLD)
        self.up_neuron = PLIFNode(D_ff, FFN_V_THRESHOLD)

    def forward(self, a, v0, plif_out):
        F_ = self.gate_proj.out_features
        beta = _sigmoid(torch.cat([self.gate_neuron.w, self.up_neuron.w]))
        one_minus = 1.0 - beta
        v_th = torch.cat([self.gate_neuron.v_th, self.up_neuron.v_th])
        i_gu = torch.cat([self.gate_proj(a), self.up_proj(a)], dim=-1)
        vpost = plif_scan(beta, i_gu * one_minus, v_th, v0)
        act = vpost * one_minus if plif_out == "leak" else vpost
        y = self.down_proj(act[..., :F_] * act[..., F_:]) + self.skip_proj(a)
        return y, vpost[-1].detach()


def ponder_aggregate(frames, halt, K):
    """PonderNet-style aggregation of each token's K frames `frames` [T*K, B, D]: halting
    p_k = clamp(sigma(halt(frame_k))), lambda_k = p_k * prod_{j<k}(1 - p_j), normalised by
    its sum (not PonderNet's remainder-to-last-step). Returns [T, B, D] and E[K] [T, B]."""
    TK, B, D = frames.shape
    T = TK // K
    p = _sigmoid(halt(frames).reshape(T, K, B)).clamp(HALT_CLAMP, 1.0 - HALT_CLAMP)
    log_stay = torch.log1p(-p)
    log_survive = torch.cat([log_stay.new_zeros(T, 1, B), log_stay[:, : K - 1].cumsum(1)], 1)
    lam = p * torch.exp(log_survive)
    lam_hat = lam / (lam.sum(1, keepdim=True) + HALT_NORM_EPS)  # [T, K, B]
    agg = (frames.reshape(T, K, B, D) * lam_hat.unsqueeze(-1)).sum(1)
    steps = torch.arange(1, K + 1, dtype=frames.dtype, device=frames.device).view(1, K, 1)
    return agg, (lam_hat * steps).sum(1)


def _centred(r):
    """Residual centring: r - mean_D(r), per token."""
    return r - r.mean(-1, keepdim=True)


class NeuronSparkDecoderLayer(nn.Module):
    """Two pre-norm sublayers: RMSNorm -> input PLIF (K frames) -> SNN block or FFN ->
    PonderAgg -> centred out projection added to the per-token residual stream."""

    def __init__(self, config):
        super().__init__()
        D = config.D
        self.snn_block = SNNBlock(D, config.N)
        self.snn_ffn = SNNFFN(D, config.D_ff)
        self.block_norm = RMSNorm(D)
        self.ffn_norm = RMSNorm(D)
        self.input_neuron1 = PLIFNode(D, INPUT_V_THRESHOLD)
        self.input_neuron2 = PLIFNode(D, INPUT_V_THRESHOLD)
        self.block_out_proj = nn.Linear(D, D, bias=False)
        self.ffn_out_proj = nn.Linear(D, D, bias=False)
        self.block_halt = nn.Linear(D, 1)
        self.ffn_halt = nn.Linear(D, 1)

    def forward(self, h, state, config):
        """`h` [T, B, D] (one vector per token), `state` (input1, hidden, input2, ffn) ->
        (h [T, B, D], new state, (E[K] of the block [T, B], of the FFN [T, B]))."""
        K, out = config.K, config.nsactor_plif_out
        v_in1, v_hidden, v_in2, v_ffn = state
        a1, v_in1 = self.input_neuron1.forward_tokens(self.block_norm(h), K, v_in1, out)
        c1, v_hidden = self.snn_block(a1, v_hidden, config.v_th_min)
        agg1, ek1 = ponder_aggregate(c1, self.block_halt, K)
        h = h + _centred(self.block_out_proj(agg1))
        a2, v_in2 = self.input_neuron2.forward_tokens(self.ffn_norm(h), K, v_in2, out)
        c2, v_ffn = self.snn_ffn(a2, v_ffn, out)
        agg2, ek2 = ponder_aggregate(c2, self.ffn_halt, K)
        h = h + _centred(self.ffn_out_proj(agg2))
        return h, (v_in1, v_hidden, v_in2, v_ffn), (ek1, ek2)


class NeuronSparkState:
    """Everything decoding carries between tokens: per layer the membrane potentials of
    input neuron 1 [B, D], the hidden neurons [B, D*N], input neuron 2 [B, D] and the FFN's
    gate and up neurons [B, 2*D_ff] (gate first), plus the output neuron's [B, D]; and `seen`,
    the tokens consumed so far (what `generate` has already fed)."""

    def __init__(self, layers, output, seen=0):
        self.layers = [tuple(s) for s in layers]
        self.output = output
        self.seen = seen

    @classmethod
    def zeros(cls, config, batch_size, device=None, dtype=torch.float32):
        z = lambda w: torch.zeros(batch_size, w, device=device, dtype=dtype)  # noqa: E731
        D, DN, F2 = config.D, config.D * config.N, 2 * config.D_ff
        return cls([(z(D), z(DN), z(D), z(F2)) for _ in range(config.num_layers)], z(D))

    def tensors(self):
        return [t for layer in self.layers for t in layer] + [self.output]

    def _map(self, f):
        layers = [tuple(f(t) for t in layer) for layer in self.layers]
        return NeuronSparkState(layers, f(self.output), self.seen)

    def clone(self):
        return self._map(torch.clone)

    def to(self, *args, **kwargs):
        return self._map(lambda t: t.to(*args, **kwargs))

    def index_select(self, batch_idx):
        """The rows `batch_idx` (reordering beams, dropping finished rows)."""
        return self._map(lambda t: t.index_select(0, batch_idx.to(t.device)))

    @property
    def batch_size(self):
        return self.output.shape[0]


@dataclass
class NeuronSparkOutput(ModelOutput):
    """`logits` [B, T, V] float32; `state` the state after the last token (None when
    `use_cache=False`); `ponder_cost` the mean E[K] over tokens, sublayers and layers (the
    reference's auxiliary loss term); `loss` with labels (next-token cross entropy only)."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    state: NeuronSparkState | None = None
    ponder_cost: torch.FloatTensor | None = None


class NeuronSparkPreTrainedModel(PreTrainedModel):
    config_class = NeuronSparkConfig
    config: NeuronSparkConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["NeuronSparkDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        """A fresh model (weights are normally loaded): the reference's init in its main lines
        (nsactor's SPEC 5), without the structured scalings of W_in and W_out."""
        cfg = self.config
        if isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, (RMSNorm,)):
            init.ones_(module.weight)
        elif isinstance(module, LateralInhibition):
            init.ones_(module.gain)
        elif isinstance(module, PLIFNode):
            init.normal_(module.w, mean=0.0, std=0.5)
            init.uniform_(module.v_th, 0.5 * module.v_threshold, 1.5 * module.v_threshold)
        elif isinstance(module, SNNBlock):
            n = torch.arange(module.N, dtype=torch.float64)
            beta_n = 0.80 + (0.99 - 0.80) * n / max(module.N - 1, 1)
            p_n = 0.25 + (0.08 - 0.25) * n / max(module.N - 1, 1)
            sigma_v = math.sqrt(0.15 / 3.0) * torch.sqrt(1.0 - beta_n**32)
            z_n = math.sqrt(2.0) * torch.erfinv(2.0 * (1.0 - p_n) - 1.0)
            b_th = (sigma_v * z_n - cfg.v_th_min).clamp_min(0.05)
            reps = module.b_beta.numel() // module.N  # hidden neuron d*N + n
            init.copy_(module.b_beta, torch.log(beta_n / (1 - beta_n)).repeat(reps).float())
            init.constant_(module.b_alpha, math.log(math.e - 1.0))
            init.copy_(module.b_th, b_th.repeat(reps).float())
        elif isinstance(module, nn.Linear):
            if module.out_features == 1:  # a halting unit
                init.uniform_(module.weight, -0.01 * math.sqrt(6.0 / (module.in_features + 1)),
                              0.01 * math.sqrt(6.0 / (module.in_features + 1)))
                init.constant_(module.bias, HALT_BIAS)
            else:
                init.kaiming_uniform_(module.weight, a=math.sqrt(5))
                if module.bias is not None:
                    init.zeros_(module.bias)


class NeuronSparkModel(NeuronSparkPreTrainedModel):
    """The whole network, embedding to logits (the decode path is part of the model: its
    output neuron carries state like the layers)."""

    def __init__(self, config):
        super().__init__(config)
        D = config.D
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.norm = LateralInhibition(D)
        self.decode_proj = nn.Linear(D, D, bias=True)
        self.output_norm = RMSNorm(D)
        self.output_neuron = PLIFNode(D, OUTPUT_V_THRESHOLD)
        self.layers = nn.ModuleList(NeuronSparkDecoderLayer(config) for _ in range(config.num_layers))
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids, state=None):
        """`input_ids` [B, T] from `state` (None: all membranes at rest) ->
        (logits [B, T, V], new state, ponder cost)."""
        cfg = self.config
        B, T = input_ids.shape
        if state is None:
            state = NeuronSparkState.zeros(cfg, B, input_ids.device, torch.float32)
        elif state.batch_size != B:
            raise ValueError(f"state holds {state.batch_size} rows, input_ids {B}")
        h = self.embed_tokens(input_ids).float().transpose(0, 1)  # [T, B, D]
        layer_states, ponder = [], []
        for layer, st in zip(self.layers, state.layers):
            h, st, (ek1, ek2) = layer(h, st, cfg)
            layer_states.append(st)
            ponder.append((ek1.mean() + ek2.mean()) / 2)
        a, v_out = self.output_neuron.forward_tokens(self.output_norm(h), cfg.K, state.output,
                                                     cfg.nsactor_plif_out)
        m = a.reshape(T, cfg.K, B, cfg.D).mean(1).transpose(0, 1)  # K-frame mean, [B, T, D]
        y = self.norm(self.decode_proj(m))
        logits = y @ self.embed_tokens.weight.float().t()  # tied head
        new_state = NeuronSparkState(layer_states, v_out, state.seen + T)
        return logits, new_state, torch.stack(ponder).mean()


class NeuronSparkForCausalLM(NeuronSparkPreTrainedModel, GenerationMixin):
    """NeuronSpark as a causal LM: `forward` (with `state` to go on from a decoding state),
    `step` (one token), `generate` (stateful: each step feeds only the new token)."""

    def __init__(self, config):
        super().__init__(config)
        self.model = NeuronSparkModel(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return None  # the head is the embedding itself (E^T), not a module

    def init_state(self, batch_size=1):
        """All membranes at rest, on the model's device."""
        return NeuronSparkState.zeros(self.config, batch_size, self.device, torch.float32)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        labels=None,
        state=None,
        use_cache=None,
        return_dict=None,
        **kwargs,
    ):
        r"""
        input_ids (`torch.LongTensor` [B, T]): token ids (no BOS is added here).
        attention_mask ([B, T], optional): only trailing padding is allowed (it cannot change
            the logits before it); the recurrent state cannot skip left padding.
        labels ([B, T], optional): the Hugging Face convention: labels are **shifted inside**
            (position t is scored on labels[t + 1]), -100 is ignored, and the loss is the mean
            next-token cross entropy. (The authors' own wrapper does not shift: it takes
            already-shifted targets, ignores id 0 and adds 0.01 * ponder_cost; add
            `output.ponder_cost` yourself for that term.)
        state (`NeuronSparkState`, optional): go on from this decoding state (None: at rest).
        use_cache (bool, optional): return the new state (default True).
        """
        if input_ids is None:
            raise ValueError("NeuronSpark needs input_ids (inputs_embeds are not supported)")
        if attention_mask is not None and attention_mask.shape[-1] == input_ids.shape[-1]:
            m = attention_mask.to(torch.long)
            if bool((m[:, 1:] > m[:, :-1]).any()):
                raise ValueError(
                    "NeuronSpark is recurrent: only trailing (right) padding is supported; "
                    "give equal-length prompts or decode them one by one"
                )
        logits, new_state, ponder = self.model(input_ids, state)
        loss = None
        if labels is not None:
            V = logits.shape[-1]
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, V),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
            )
        use_cache = True if use_cache is None else use_cache
        out = NeuronSparkOutput(loss=loss, logits=logits,
                                state=new_state if use_cache else None, ponder_cost=ponder)
        if return_dict is False:
            return out.to_tuple()
        return out

    @torch.no_grad()
    def step(self, input_ids, state=None):
        """Feeds `input_ids` ([B] or [B, T]) from `state` (None: at rest) and returns
        (logits of the last position [B, V], new state): token-by-token decoding."""
        if input_ids.dim() == 1:
            input_ids = input_ids[:, None]
        logits, new_state, _ = self.model(input_ids, state)
        return logits[:, -1], new_state

    # ---- generate: the state travels in model_kwargs["state"] (no Cache object) ----

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # the state is the model's own; generate must not make a KV cache

    def generate(self, *args, **kwargs):
        """GenerationMixin.generate, stateful. Beam search and assisted decoding reorder or
        roll back the sequences, which a recurrent state cannot follow here: they recompute
        from the whole sequence at each step instead (`use_cache=False`)."""
        gc = kwargs.get("generation_config") or self.generation_config
        if (kwargs.get("num_beams") or gc.num_beams or 1) > 1 or kwargs.get("assistant_model"):
            kwargs["use_cache"] = False
        return super().generate(*args, **kwargs)

    def _reorder_cache(self, cache, beam_idx):
        return cache  # beam search runs with use_cache=False: no state to reorder

    def prepare_inputs_for_generation(
        self, input_ids, state=None, attention_mask=None, use_cache=None, **kwargs
    ):
        if state is None and attention_mask is not None and input_ids.shape[1] > 1:
            m = attention_mask.to(torch.long)
            if bool((m[:, 1:] > m[:, :-1]).any()):
                raise ValueError("NeuronSpark cannot generate from left-padded prompts")
        if use_cache is False:
            state = None  # recompute from the whole sequence
        elif state is not None:
            input_ids = input_ids[:, state.seen :]  # only the tokens not yet fed
        return {"input_ids": input_ids.contiguous(), "state": state, "use_cache": use_cache}

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False,
                                            num_new_tokens=1):
        model_kwargs = super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=is_encoder_decoder,
            num_new_tokens=num_new_tokens,
        )
        model_kwargs["state"] = outputs.get("state") if model_kwargs.get("use_cache", True) else None
        return model_kwargs


__all__ = [
    "NeuronSparkForCausalLM",
    "NeuronSparkModel",
    "NeuronSparkPreTrainedModel",
    "NeuronSparkState",
    "plif_scan",
]
