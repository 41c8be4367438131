"""The EAGLE-3 drafter module: the fused target states -> one decoder layer -> a draft-vocabulary head.

Architecture (EAGLE-3's reference code; docs/methods.md section 13):
  * ``fc``: Linear(3H -> H, no bias) over the concatenated low, middle and high target states
    (`aux_layers`, Hugging Face ``hidden_states`` indices);
  * one decoder layer: the attention input is ``[input_norm(embed(token)); hidden_norm(h)]`` (2H), the
    target's attention shape (GQA, RoPE), residual ``h`` (``norm_before_residual: false``), then a SwiGLU MLP;
  * ``norm`` and an LM head over the draft vocabulary (a `PrunedHead` of the target's head: the kept ids
    are EAGLE's ``d2t`` / ``t2d``), or the target's own head when ``vocab_keep`` is null;
  * the target's token embedding, frozen and shared (not stored in the checkpoint);
  * EAGLE 3.1's options (off by default): ``norm_before_fc`` (one RMSNorm over the 3H concatenation),
    ``fc_norm`` (an RMSNorm on each of the three states) before ``fc``, and ``norm_output`` (a step feeds the
    next its output after ``norm``, the state its logits read, instead of the pre-norm one), as vLLM runs them.

Index convention: step 0 at index i reads the target state f_i and token t_{i+1} and predicts t_{i+2};
step k (k >= 1) at index i reads step k-1's output state at i and token t_{i+k+1}, sits at RoPE position
i + k and attends to step 0's keys 0..i plus the keys of steps 1..k at the same index (the training-time
test). At decoding, the committed prefix is step 0, and a tree node at depth d is step d at index L-1:
its keys are the prefix's and its ancestors'. Training (`ttt`) and decoding (`decode.Eagle3Drafter`) share
the layer (`draftsmith.common.layers.DecoderLayer`, two inputs), so they compute the same function (a test
checks it).
"""

from __future__ import annotations

import math

import torch
from draftsmith.common.hidden_cache import HiddenCache, decoder_of
from draftsmith.common.layers import DecoderLayer, RMSNorm, target_rope
from draftsmith.common.vocab import PrunedVocab
from draftsmith.drafters.eagle3.config import Eagle3ModelConfig, default_aux_layers
from draftsmith.drafters.eagle3.decode import Eagle3Drafter
from draftsmith.drafters.eagle3.fast import FastEagle3, fuse_states
from draftsmith.drafters.eagle3.objective import Eagle3Objective, heldout_metrics, rank_acceptance
from draftsmith.engine.policies import FixedLength
from draftsmith.registry import KindBase, register
from torch import nn


def check_aux_layers(aux: list[int], num_layers: int) -> None:
    if len(aux) != 3 or not all(1 <= i < num_layers for i in aux) or sorted(set(aux)) != list(aux):
        raise ValueError(f"aux_layers {aux} do not fit a target with {num_layers} layers: three increasing indices "
                         f"in [1, {num_layers - 1}] are needed (the usual choice for it, which a recipe gets by "
                         f"leaving aux_layers out: {default_aux_layers(num_layers)})")


@register
class Eagle3Module(PrunedVocab, KindBase, nn.Module):
    kind = "eagle3"
    builds_trees = True  # from its steps' acceptance by rank (`rank_acceptance`), as Hydra's from its heads'
    conditional_accuracy = True  # step k's figures are over the indices where steps 1..k-1 drafted right

    config_class = Eagle3ModelConfig

    def __init__(self, config: Eagle3ModelConfig, lm_head: nn.Module, embed: nn.Module, rotary: nn.Module):
        super().__init__()
        c = config
        check_aux_layers(list(c.aux_layers), c.num_layers)
        if c.train_head and not c.vocab_keep:
            raise ValueError("train_head trains the draft vocabulary's head: it needs vocab_keep")
        self.config = c
        self.aux_layers, self.ttt_steps, self.step_decay = list(c.aux_layers), c.ttt_steps, c.step_decay
        self.draft_len = c.draft_len
        hidden_size, eps = c.hidden_size, c.eps
        self.fc = nn.Linear(3 * hidden_size, hidden_size, bias=False)
        self.input_norm = RMSNorm(3 * hidden_size, eps) if c.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(hidden_size, eps) for _ in range(3)) if c.fc_norm else None
        # the shared decoder layer, reading [input_norm(embed(token)); hidden_norm(h)], with the target's RoPE
        # (frequencies and scaling copied into a buffer of the layer's: casting the drafter leaves the target's alone)
        inv_freq, rope_scale = target_rope(rotary)
        self.layer = DecoderLayer(hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, eps,
                                  inputs=2, inv_freq=inv_freq, rope_scale=rope_scale)
        self.norm = RMSNorm(hidden_size, eps)
        self.lm_head, self.embed = lm_head, embed  # the target's, frozen and not stored
        self.shared_with_target = ("lm_head", "embed")
        self.init_pruned_vocab(lm_head, c.vocab_keep)
        if self.draft_head is not None and c.train_head:
            self.draft_head.requires_grad_(True)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def cache_needs(config: dict) -> list[str]:
        if config.get("aux_layers") is None:
            raise ValueError("EAGLE-3's aux_layers are derived from the target's layer count: fill the recipe's "
                             "drafter section for the target first (`with_target`)")
        return [f"layer:{int(i)}" for i in config["aux_layers"]] + ["final"]

    @classmethod
    def for_target(cls, target, **fields) -> "Eagle3Module":
        """A fresh drafter for ``target`` from a recipe's fields: random layer and ``fc``, the target's embedding
        and head rows."""
        if fields.get("aux_layers") is None:
            fields = {**fields, "aux_layers": default_aux_layers(int(target.model.config.num_hidden_layers))}
        config = cls.read_config({**Eagle3ModelConfig.of(target), **fields})
        m = cls(config, target.lm_head, target.model.get_input_embeddings(), decoder_of(target.model).rotary_emb)
        p = next(target.model.parameters())
        return m.to(device=p.device)

    @classmethod
    def from_config(cls, config, target) -> "Eagle3Module":
        config = cls.read_config(config)
        config.check_layers(target, "EAGLE-3")
        return cls(config, target.lm_head, target.model.get_input_embeddings(), decoder_of(target.model).rotary_emb)

    @classmethod
    def make_objective(cls, recipe, cache: HiddenCache, target, exclude: set[int]) -> Eagle3Objective:
        d, t = recipe.drafter, recipe.train
        return Eagle3Objective(cache, target, d.aux_layers, d.ttt_steps, d.step_decay, chunk_len=t.chunk_len,
                               exclude=exclude)

    def heldout_metrics(self, cache: HiddenCache, target) -> dict:
        return heldout_metrics(self, cache, target)

    def rank_acceptance(self, cache: HiddenCache, target, sequences=None, ranks: int = 10) -> dict:
        """Per step, acceptance by draft rank on the accepted path: what the trees stage builds trees from."""
        return rank_acceptance(self, cache, target, sequences=sequences, ranks=ranks)

    def decoder_drafter(self, target, target_fingerprint: str | None = None, name: str = "eagle3") -> Eagle3Drafter:
        return Eagle3Drafter(target, self, target_fingerprint=target_fingerprint, name=name,
                             policy=FixedLength(self.draft_len))

    def engine_gap(self, engine: str) -> str | None:
        """llama.cpp (the build scripts/llamacpp_env.sh makes) reads ``norm_before_fc`` but neither of EAGLE 3.1's
        other options; vLLM reads all three."""
        if engine == "llama.cpp":
            off = [k for k in ("fc_norm", "norm_output") if getattr(self.config, k)]
            return f"EAGLE 3.1's {' and '.join(off)}" if off else None
        return None

    def fast_drafting(self, compile: bool = True, int8: bool | None = None,
                      dtype: torch.dtype | None = None) -> FastEagle3:
        """Compiled drafting (drafters/eagle3/fast.py), used by decoders whose target forward is compiled; ``int8``:
        weight-only int8 layer and head (default: on CPU in bf16/fp16, `int8_by_default`); ``dtype``: the dtype drafting
        computes in (default: the module's, bf16 for a float32 one on a CPU with native bf16, `drafting_dtype`)."""
        return FastEagle3(self, compile=compile, int8=int8, dtype=dtype)

    # ------------------------------------------------------------------ shared pieces
    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Output states [..., H] -> logits over the draft vocabulary [..., N] (V without pruning)."""
        return self.vocab_logits(self.norm(h))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).to(self.fc.weight.dtype)

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Fused target states [..., 3H] -> step 0's input state [..., H] (`fuse_states`)."""
        return fuse_states(feats.to(self.fc.weight.dtype), self.fc, self.input_norm, self.fc_norm)

    def carry(self, out: torch.Tensor) -> torch.Tensor:
        """A step's output state -> the state the next step reads: the same, or with ``norm_output`` after
        ``norm`` (the logits read ``norm(out)`` either way)."""
        return self.norm(out) if self.config.norm_output else out

    # ------------------------------------------------------------------ training-time test
    def ttt(self, feats: torch.Tensor, next_ids: torch.Tensor, steps: int | None = None) -> list[torch.Tensor]:
        """feats [B, T, 3H] (f_i), next_ids [B, T + steps] (token t_{i+1} at column i, right-padded) ->
        per step k the draft logits [B, T, N] at every index i (meaningful where i + k + 2 is in range)."""
        steps = steps or self.ttt_steps
        B, T, _ = feats.shape
        L = self.layer
        h = self.fuse(feats)
        pos = torch.arange(T, device=feats.device).expand(B, T)
        scale = 1.0 / math.sqrt(L.hd)
        causal = torch.ones(T, T, dtype=torch.bool, device=feats.device).tril()
        k0 = v0 = None
        diag_k, diag_v, out = [], [], []
        for k in range(steps):
            q, kk, vv = L.qkv(L.attention_input(self.embed_tokens(next_ids[:, k: k + T]), h), pos + k)
            if k == 0:
                k0, v0 = L.expand(kk), L.expand(vv)
            else:
                diag_k.append(L.expand(kk))
                diag_v.append(L.expand(vv))
            s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
            s0 = s0.masked_fill(~causal, torch.finfo(s0.dtype).min)
            sd = [(q * dk).sum(-1, keepdim=True) * scale for dk in diag_k]  # each [B, nh, T, 1]
            w = torch.softmax(torch.cat([s0, *sd], dim=-1).float(), dim=-1).to(q.dtype)
            a = w[..., :T] @ v0
            for s, dv in enumerate(diag_v):
                a = a + w[..., T + s: T + s + 1] * dv
            h = L.finish(h, a)
            out.append(self.project(h))
            h = self.carry(h)
        return out

    def forward(self, feats: torch.Tensor, next_ids: torch.Tensor) -> list[torch.Tensor]:
        """The training-time test (one call through a possibly DDP-wrapped module)."""
        return self.ttt(feats, next_ids)
