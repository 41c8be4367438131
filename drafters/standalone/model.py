"""Standalone distilled drafters: a small causal LM over the target's tokenizer (docs/methods.md sections 1, 7, 8).

The drafter is any Hugging Face causal LM whose vocabulary is the target's:
  * ``init: target``: the target's first ``num_layers`` layers, embeddings,
    final norm and output head (the untrained ``first-layers:N`` baseline,
    then distilled);
  * ``init: scratch``: a fresh Llama from the target's config with the
    recipe's sizes (layers, hidden, heads, kv heads, intermediate);
  * ``init: /a/local/hf/dir``: a user's model; its tokenizer must have the
    target's exact vocabulary (token -> id) and its embedding the same rows,
    else it is refused with the first difference named.

Training (`StandaloneObjective`): the drafter reads tokens 0..t of a cached
sequence and at position t predicts token t+1, like the target; the teacher
is the target's distribution at t, recomputed from the cached final state
through the frozen output head. Positions count when token t+1 is an
assistant token. The loss is one of `draftsmith.common.divergences`
(forward KL, reverse KL, total variation, DistillSpec's JSD[beta]).
Embeddings and the output head are frozen unless ``train_embeddings`` (the
default for ``scratch``). ``lora`` trains peft LoRA adapters instead of the
layers' weights; checkpoints hold the merged weights.

Pruned vocabulary (``vocab_keep``, heads/vocab.py's selection and
`PrunedHead`): the drafter projects onto the N most frequent assistant-token
ids only, trained against the target renormalised over them; drafting puts
q = 0 at every other id. ``rdk: true`` also stores a sparse token-affinity
map (drafters/rdk.py, docs/rdk.md) and drafts from q_RDK = M^T q'.
Decoding: `draftsmith.drafters.standalone.decode.StandaloneModelDrafter`
(`ModelDrafter` with a target-space head).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from draftsmith.common.divergences import DIVERGENCES, divergence
from draftsmith.drafters.standalone.config import StandaloneModelConfig
from draftsmith.drafters.standalone.rdk import RDKMap, build_rdk
from draftsmith.drafters.standalone.decode import StandaloneModelDrafter
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.engine.policies import FixedLength
from draftsmith.common.chunks import make_chunks
from draftsmith.common.vocab import PrunedHead, PrunedVocab, draft_head
from draftsmith.registry import KindBase, register
from draftsmith.common.hidden_cache import HiddenCache, teacher_logits
from draftsmith.common.losses import topk_hits


class TokenizerMismatchError(ValueError):
    """A user's drafter model whose tokenizer or embedding differs from the target's."""


def check_same_vocabulary(path: str | Path, target) -> None:
    """Refuse a model directory whose tokenizer vocabulary (token -> id) is not exactly the target's."""
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise TokenizerMismatchError(f"{path}: no tokenizer could be loaded ({e}); a standalone drafter must "
                                     f"ship the target's tokenizer") from None
    mine, theirs = tok.get_vocab(), target.tokenizer.get_vocab()
    if mine != theirs:
        extra = sorted(set(mine) - set(theirs))[:3]
        missing = sorted(set(theirs) - set(mine))[:3]
        moved = [t for t in sorted(set(mine) & set(theirs)) if mine[t] != theirs[t]][:3]
        raise TokenizerMismatchError(
            f"{path}: its tokenizer is not the target's ({len(mine)} vs {len(theirs)} tokens; not in the target's: "
            f"{extra}, missing: {missing}, other ids: {moved}); a standalone drafter must use the target's "
            f"vocabulary (drafters with their own tokenizer: TLI/SLEM)")


def _model_from_config(cfg: dict) -> nn.Module:
    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))


def _set_size(cfg, **sizes) -> None:
    for k, v in sizes.items():
        if v is not None:
            setattr(cfg, k, int(v))


@register
class StandaloneDrafter(PrunedVocab, KindBase, nn.Module):
    """A standalone causal-LM drafter (``model``), optionally over a pruned vocabulary (``draft_head``, ``rdk``)."""

    kind = "standalone"

    config_class = StandaloneModelConfig

    def __init__(self, config: StandaloneModelConfig, model: nn.Module, *, add_lora: bool = True):
        """``config.model`` is set from ``model`` when empty; ``add_lora``: False for a checkpoint's weights
        (LoRA-merged: a plain model; its config keeps ``lora`` as provenance)."""
        super().__init__()
        c = config
        if c.rdk and not c.vocab_keep:
            raise ValueError("standalone rdk: true needs vocab_keep (RDK redistributes a pruned vocabulary)")
        self.model = model
        head = model.get_output_embeddings()
        V = int(head.weight.shape[0])
        if c.vocab_keep is not None and not 1 <= int(c.vocab_keep) <= V:
            raise ValueError(f"vocab_keep {c.vocab_keep} must keep between 1 and the vocabulary's {V} ids")
        self.init_pruned_vocab(head, c.vocab_keep)
        self.rdk = RDKMap(torch.arange(int(c.vocab_keep)), V) if c.rdk else None
        self.divergence, self.jsd_beta, self.draft_len = c.divergence, float(c.jsd_beta), int(c.draft_len)
        self.rdk_positions, self.rdk_topk = int(c.rdk_positions), int(c.rdk_topk)
        tied = model.get_input_embeddings().weight is head.weight
        # A tied output head is the embedding: saved once (safetensors refuses shared tensors), re-tied on load.
        self.shared_with_target = ("model.lm_head",) if tied else ()
        train_embeddings = c.train_embeddings if c.train_embeddings is not None else c.init == "scratch"
        self.lora_config = c.lora.model_dump() if c.lora is not None and add_lora else None
        self.config = c.model_copy(update={"model": c.model or model.config.to_dict(),
                                           "train_embeddings": bool(train_embeddings)})
        self.model.requires_grad_(True)
        if not train_embeddings:
            model.get_input_embeddings().requires_grad_(False)
            head.requires_grad_(False)
        if self.lora_config:
            self._add_lora(self.lora_config)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def cache_needs(config: dict) -> list[str]:
        return ["final"]

    @classmethod
    def for_target(cls, target, seed: int = 0, **fields) -> "StandaloneDrafter":
        """A fresh drafter for ``target`` from a recipe's fields (see the module doc for ``init``); ``seed``: a
        scratch network's initialisation."""
        config = cls.read_config(fields)
        init, num_layers, hidden_size = config.init, config.num_layers, config.hidden_size
        num_heads, num_kv_heads, intermediate_size = config.num_heads, config.num_kv_heads, config.intermediate_size
        sizes = {"hidden_size": hidden_size, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
                 "intermediate_size": intermediate_size}
        if init == "target":
            set_sizes = [k for k, v in sizes.items() if v is not None]
            if set_sizes:
                raise ValueError(f"standalone init: target copies the target's layer shapes; leave {set_sizes} unset "
                                 f"(or use init: scratch)")
            model = first_layers_drafter(target, num_layers).model
        elif init == "scratch":
            cfg = copy.deepcopy(target.model.config)
            cfg.num_hidden_layers = int(num_layers)
            if getattr(cfg, "layer_types", None):
                cfg.layer_types = list(cfg.layer_types)[:1] * int(num_layers)
            _set_size(cfg, **sizes)
            if num_heads is not None and hidden_size is not None:
                cfg.head_dim = int(hidden_size) // int(num_heads)
            elif hidden_size is not None or num_heads is not None:
                cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
            if cfg.num_attention_heads % cfg.num_key_value_heads:
                raise ValueError(f"standalone num_heads {cfg.num_attention_heads} must be a multiple of "
                                 f"num_kv_heads {cfg.num_key_value_heads}")
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg)
        else:
            path = Path(init)
            if not (path / "config.json").is_file():
                raise ValueError(f"standalone init {init!r}: not 'target', 'scratch' or a local Hugging Face model "
                                 f"directory (no config.json there)")
            check_same_vocabulary(path, target)
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
            rows = int(model.get_input_embeddings().weight.shape[0])
            if rows != target.vocab_size:
                raise TokenizerMismatchError(f"{path}: its embedding has {rows} rows, the target's vocabulary "
                                             f"{target.vocab_size}")
        model = model.float()
        model.generation_config = copy.deepcopy(target.model.generation_config)
        return cls(config, model)

    @classmethod
    def from_config(cls, config, target) -> "StandaloneDrafter":
        """The module a checkpoint's weights load into (LoRA already merged: a plain model)."""
        config = cls.read_config(config)
        cfg = dict(config.model)
        if int(cfg.get("vocab_size", -1)) != target.vocab_size:
            raise ValueError(f"standalone drafter vocabulary {cfg.get('vocab_size')} is not the target's "
                             f"{target.vocab_size}")
        model = _model_from_config(cfg).float()
        model.generation_config = copy.deepcopy(target.model.generation_config)
        return cls(config, model, add_lora=False)

    @staticmethod
    def make_objective(recipe, cache: HiddenCache, target, exclude: set[int] | None = None) -> "StandaloneObjective":
        d, t = recipe.drafter, recipe.train
        return StandaloneObjective(cache, target, d.divergence, d.jsd_beta, chunk_len=t.chunk_len, exclude=exclude)

    # ------------------------------------------------------------------ LoRA
    def _add_lora(self, cfg: dict) -> None:
        from peft import LoraConfig, get_peft_model  # optional dependency, only for LoRA runs
        lc = LoraConfig(r=int(cfg.get("rank", 8)), lora_alpha=float(cfg.get("alpha", 16)),
                        lora_dropout=float(cfg.get("dropout", 0.0)),
                        target_modules=list(cfg.get("targets", ["q_proj", "k_proj", "v_proj", "o_proj"])))
        self.model = get_peft_model(self.model, lc)  # freezes every base weight, adapters trainable

    def lm(self) -> nn.Module:
        """The causal LM being trained (inside the peft wrapper when LoRA is on)."""
        return self.model.get_base_model() if self.lora_config else self.model

    def plain_model(self) -> nn.Module:
        """A plain transformers model: the LoRA adapters merged into a copy, or the model itself."""
        if not self.lora_config:
            return self.model
        return copy.deepcopy(self.model).merge_and_unload()

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Checkpoint weights: with LoRA, the merged plain model's (names as without LoRA)."""
        self.sync_draft_head()
        if not self.lora_config:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        out = {} if destination is None else destination
        for k, v in self.plain_model().state_dict(keep_vars=keep_vars).items():
            out[f"{prefix}model.{k}"] = v
        for name in ("draft_head", "rdk"):
            mod = getattr(self, name)
            if mod is not None:
                for k, v in mod.state_dict(keep_vars=keep_vars).items():
                    out[f"{prefix}{name}.{k}"] = v
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self.lora_config:
            raise ValueError("a LoRA run's checkpoints hold merged weights: exact resume of a LoRA run is not "
                             "supported; restart it (--fresh)")
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self.rdk is not None and self.draft_head is not None:
            self.rdk.kept_ids = self.draft_head.kept_ids.clone()
        return out

    # ------------------------------------------------------------------ vocabulary
    @torch.no_grad()
    def sync_draft_head(self) -> None:
        """The pruned head's rows = the (possibly trained) output head's kept rows."""
        if self.draft_head is not None:
            self.draft_head.set_kept(self.draft_head.kept_ids, self.lm().get_output_embeddings())

    def full_head(self) -> nn.Module:
        return self.lm().get_output_embeddings()

    def draft_vocab_set(self) -> None:
        if self.rdk is not None:  # RDK samples the pruned ids: it follows the kept ones
            self.rdk.kept_ids = self.draft_head.kept_ids.clone()

    def fit_to_cache(self, cache: HiddenCache, target, exclude: set[int] | None = None) -> dict | None:
        """Trainer hook after the vocabulary is chosen: build the RDK affinity map from the target's
        distributions on the training positions."""
        if self.rdk is None:
            return None
        parent, weight, info = build_rdk(cache, target, self.draft_head.kept_ids.cpu(), exclude,
                                         self.rdk_positions, self.rdk_topk)
        self.rdk.set(self.draft_head.kept_ids.cpu(), parent, weight)
        return {"rdk": info}

    # ------------------------------------------------------------------ math
    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> logits over the kept ids (pruned) or the full vocabulary."""
        head = self.lm().get_output_embeddings()
        if self.draft_head is None:
            return head(h)
        if head.weight.requires_grad:  # a trained head: its kept rows, gathered so gradients reach it
            return F.linear(h, head.weight[self.draft_head.kept_ids])
        return self.draft_head(h)

    def forward(self, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Right-padded token ids [B, T] -> logits [P, N or V] at the rows [B, T] (bool) selected."""
        h = self.lm().get_decoder()(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
        return self.project(h[rows])

    def decoder_drafter(self, target, target_fingerprint: str | None = None, name: str = "standalone",
                        use_rdk: bool | None = None) -> StandaloneModelDrafter:
        """This drafter for the engine: the plain model, the pruned head (q = 0 off the kept ids) and, when
        the checkpoint has one and ``use_rdk`` is not False, the RDK redistribution."""
        self.sync_draft_head()
        rdk = self.rdk if (use_rdk is None or use_rdk) else None
        if use_rdk and self.rdk is None:
            raise ValueError("this checkpoint has no RDK map (train it with rdk: true)")
        p = next(target.model.parameters())
        model = self.plain_model().to(device=p.device, dtype=p.dtype)
        dh = None if self.draft_head is None else copy.deepcopy(self.draft_head).to(device=p.device, dtype=p.dtype)
        return StandaloneModelDrafter(model, draft_head=dh,
                                      rdk=None if rdk is None else copy.deepcopy(rdk).to(p.device),
                                      target_fingerprint=target_fingerprint, name=name,
                                      policy=FixedLength(self.draft_len))

    def to_hf_model(self) -> nn.Module:
        """The plain transformers model (export ``hf``); a pruned drafter exports its full-size output head."""
        m = copy.deepcopy(self.plain_model())
        m.config.draftsmith_vocab_keep = self.config.vocab_keep
        return m

    def heldout_metrics(self, cache: HiddenCache, target) -> dict:
        """`heldout_metrics` of this drafter on a cache (the report stage's held-out MT-Bench answers)."""
        return heldout_metrics(self, cache, target)


# ---------------------------------------------------------------------- training objective
@dataclass
class StandaloneBatch:
    ids: torch.Tensor  # [B, T] right-padded tokens 0..hi-1 of each window's sequence
    attn: torch.Tensor  # [B, T]
    rows: torch.Tensor  # [B, T] bool: positions t in [lo, hi) whose token t+1 is an assistant token
    labels: torch.Tensor  # [P] token t+1 of every selected row (row-major order)
    teacher: torch.Tensor  # [P, V] the target's logits at t

    @property
    def positions(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device) -> "StandaloneBatch":
        return StandaloneBatch(*(x.to(device) for x in (self.ids, self.attn, self.rows, self.labels, self.teacher)))


class StandaloneObjective:
    """Windows of cached sequences; the drafter at t against the target's distribution at t (both predict t+1)."""

    def __init__(self, cache: HiddenCache, target, divergence: str = "fkl", beta: float = 0.5,
                 chunk_len: int = 128, exclude: set[int] | None = None):
        if divergence not in DIVERGENCES:
            raise ValueError(f"unknown divergence {divergence!r}; choose one of {DIVERGENCES}")
        if "final" not in cache.index.get("needs", []):
            raise ValueError(f"cache {cache.path} holds {cache.index.get('needs')}; a standalone drafter needs "
                             f"['final']: rebuild it")
        self.cache, self.target, self.kind, self.beta = cache, target, divergence, beta
        self.chunks = make_chunks(cache, chunk_len, min_offset=1, exclude=exclude)
        if not self.chunks:
            raise ValueError("the cache holds no trainable positions (no assistant tokens); check the data stage")

    @torch.no_grad()
    def window(self, i: int, lo: int, hi: int):
        tok, m = self.cache.tokens(i), self.cache.mask(i)
        n = len(tok)
        t = np.arange(lo, hi)
        keep = (t + 1 < n) & (m[np.minimum(t + 1, n - 1)] > 0)
        if not keep.any():
            return None
        teacher = teacher_logits(self.target, self.cache.states(i, "final", lo, hi))[torch.from_numpy(keep)]
        return (torch.from_numpy(tok[:hi].astype(np.int64)), lo, torch.from_numpy(keep),
                torch.from_numpy(tok[t[keep] + 1].astype(np.int64)), teacher)

    @torch.no_grad()
    def prepare(self, chunk_ids: list[int]) -> StandaloneBatch:
        parts = [p for p in (self.window(*self.chunks[c]) for c in chunk_ids) if p is not None]
        T = max(len(p[0]) for p in parts)
        ids = torch.zeros(len(parts), T, dtype=torch.long)
        attn = torch.zeros(len(parts), T, dtype=torch.long)
        rows = torch.zeros(len(parts), T, dtype=torch.bool)
        for b, (tok, lo, keep, _, _) in enumerate(parts):
            ids[b, :len(tok)] = tok
            attn[b, :len(tok)] = 1
            rows[b, lo:lo + len(keep)] = keep
        return StandaloneBatch(ids, attn, rows, torch.cat([p[3] for p in parts]), torch.cat([p[4] for p in parts]))

    def loss(self, model, batch: StandaloneBatch) -> tuple[torch.Tensor, dict]:
        logits = model(batch.ids, batch.attn, batch.rows)  # one call through the (possibly DDP-wrapped) module
        dh = draft_head(model)
        teacher = batch.teacher if dh is None else batch.teacher[:, dh.kept_ids]  # renormalised by the softmax
        return divergence(logits, teacher, self.kind, self.beta), {"logits": logits.detach(), "draft_head": dh}

    @torch.no_grad()
    def stats(self, aux: dict, batch: StandaloneBatch) -> dict:
        """Top-1/top-5 on token t+1 (a pruned label is a miss), agreement with the teacher's argmax, and the
        expected acceptance sum_x min(p, q) in target-id space."""
        lg, dh = aux["logits"].float(), aux["draft_head"]
        labels, argmax = batch.labels, batch.teacher.argmax(-1)
        if dh is not None:
            labels, argmax = dh.labels(labels)[1], dh.labels(argmax)[1]
        hits, agree = topk_hits(lg, labels), topk_hits(lg, argmax, ks=(1,))
        return {"head1/top1": hits[1], "head1/top5": hits[5], "teacher/top1": agree[1],
                "expected_acceptance": float(acceptance(lg, batch.teacher, dh).mean())}


def acceptance(draft_logits: torch.Tensor, target_logits: torch.Tensor, dh: PrunedHead | None = None,
               rdk: RDKMap | None = None) -> torch.Tensor:
    """Per row sum_x min(p(x), q(x)) in target-id space (q = 0 off the kept ids, or q_RDK)."""
    p = torch.softmax(target_logits.float(), dim=-1)
    q = torch.softmax(draft_logits.float(), dim=-1)
    if rdk is not None:
        return torch.minimum(p, rdk.redistribute(q)).sum(-1)
    if dh is not None:
        p = p[:, dh.kept_ids]
    return torch.minimum(p, q).sum(-1)


@torch.no_grad()
def heldout_metrics(model: StandaloneDrafter, cache: HiddenCache, target, windows_per_batch: int = 8) -> dict:
    """Figures over every labelled position of a cache: ``expected_acceptance`` (alpha of a sampled draft at
    T = 1), ``greedy_acceptance`` (argmax q == argmax p), top-1/top-5 on the data's token t+1, and with an
    RDK map the same two acceptances under q_RDK. A pruned head also reports ``target_mass_off_kept``: the
    target's mean probability on the pruned ids, the most any off-set proposal (RDK's) can add to alpha; with an
    RDK map also the alpha of a perfectly distilled pruned drafter (q' = the target renormalised over the kept
    ids), drafting from q' alone (``oracle_acceptance``, = 1 - the off-set mass) and from q_RDK
    (``oracle_acceptance_rdk``)."""
    obj = StandaloneObjective(cache, target, chunk_len=1 << 30)
    dh, rdk = model.draft_head, model.rdk
    sums = {"expected_acceptance": 0.0, "greedy_acceptance": 0.0, "top1": 0.0, "top5": 0.0}
    if rdk is not None:
        sums.update(expected_acceptance_rdk=0.0, greedy_acceptance_rdk=0.0, rdk_mass_off_kept=0.0,
                    oracle_acceptance=0.0, oracle_acceptance_rdk=0.0)
    if dh is not None:
        sums.update(target_mass_off_kept=0.0)
    n = 0
    model.eval()
    for s in range(0, len(obj.chunks), windows_per_batch):
        b = obj.prepare(list(range(s, min(s + windows_per_batch, len(obj.chunks)))))
        lg = model(b.ids, b.attn, b.rows).float()
        full = lg if dh is None else dh.to_target(lg)
        tgt_arg = b.teacher.argmax(-1)
        sums["expected_acceptance"] += float(acceptance(lg, b.teacher, dh).sum())
        sums["greedy_acceptance"] += float((full.argmax(-1) == tgt_arg).sum())
        h = topk_hits(full, b.labels)
        sums["top1"] += h[1][0]
        sums["top5"] += h[5][0]
        if dh is not None:
            kept_mass = torch.softmax(b.teacher.float(), -1)[:, dh.kept_ids].sum(-1)
            sums["target_mass_off_kept"] += float((1 - kept_mass).clamp_min(0).sum())
        if rdk is not None:
            qr = rdk.redistribute(torch.softmax(lg, -1))
            sums["rdk_mass_off_kept"] += float((1 - qr[:, dh.kept_ids].sum(-1)).clamp_min(0).sum())
            oracle = b.teacher.float()[:, dh.kept_ids]  # the perfect pruned drafter's logits
            sums["oracle_acceptance"] += float(acceptance(oracle, b.teacher, dh).sum())
            sums["oracle_acceptance_rdk"] += float(acceptance(oracle, b.teacher, dh, rdk).sum())
            sums["expected_acceptance_rdk"] += float(acceptance(lg, b.teacher, dh, rdk).sum())
            sums["greedy_acceptance_rdk"] += float((qr.argmax(-1) == tgt_arg).sum())
        n += b.positions
    out = {"positions": n, **{k: v / max(n, 1) for k, v in sums.items()}}
    a = out["greedy_acceptance"]
    out["predicted_chain_tau"] = sum(a ** k for k in range(model.draft_len + 1))
    return out
