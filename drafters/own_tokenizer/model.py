"""A drafter with its own tokenizer: a small BPE tokenizer trained on the
self-distilled text, a small Llama over it, and the bridge between its vocabulary and the target's.

* `train_bpe_tokenizer`: a byte-level BPE (the `tokenizers` library) with the target's pre-tokenizer
  type (ByteLevel, no prefix space) and the target's special tokens, so token strings of both
  vocabularies are written the same way (``Ġthe``) and the chat markers are shared;
* `VocabBridge`: the intersection of the two vocabularies by token string (as in 2502.05202 and
  Hugging Face's ``AssistantToTargetTranslator``), target ids -> text -> drafter ids, and drafter
  logits -> target-vocabulary logits with -inf outside the intersection;
* `OwnTokenizerDrafter`: the registered kind ``own-tokenizer`` (a `LlamaForCausalLM` over the
  drafter's vocabulary + its tokenizer). It is trained by sequence-level distillation: next-token
  cross-entropy on target-written text re-tokenised with its own tokenizer (see
  ``draftsmith.drafters.own_tokenizer.training``). Its checkpoint is the usual safetensors + config + manifest (target
  fingerprint) plus ``tokenizer.json``, whose sha256 is in the config.

Decoding adapters (TLI, SLEM) live in `draftsmith.drafters.own_tokenizer.decode`.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from draftsmith.checkpoint import CheckpointError, MissingFileError
from draftsmith.drafters.own_tokenizer.config import OwnTokenizerModelConfig
from draftsmith.drafters.own_tokenizer.decode import TLIDrafter
from draftsmith.registry import KindBase, register
from draftsmith.target import Target

TOKENIZER_FILE = "tokenizer.json"
# Llama fields a recipe may set; the rest follow the target's (rope, norm eps, activation).
LLAMA_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings")


class VocabularyError(ValueError):
    """Two vocabularies that cannot be bridged (e.g. no token string in common)."""


def target_special_tokens(target_tokenizer) -> list[str]:
    """The target's special tokens (chat markers, EOS): the drafter's tokenizer gets them verbatim."""
    specials = list(getattr(target_tokenizer, "all_special_tokens", []) or [])
    return list(dict.fromkeys(s for s in specials if s))


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, special_tokens: list[str],
                        min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``texts`` (every byte is in its alphabet: nothing is unknown)."""
    if vocab_size < 256 + len(special_tokens) + 1:
        raise ValueError(f"tokenizer vocab_size {vocab_size} is too small: a byte-level BPE needs the 256 bytes "
                         f"and {len(special_tokens)} special tokens, so at least {257 + len(special_tokens)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer_file(path: str | Path) -> Tokenizer:
    """A `tokenizers` JSON file, or a `CheckpointError` naming the file when it is missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: missing (the drafter's tokenizer)")
    try:
        return Tokenizer.from_str(path.read_text())
    except (UnicodeDecodeError, Exception) as e:  # tokenizers raises a bare Exception on bad JSON
        raise CheckpointError(f"{path}: not a valid tokenizers JSON file ({str(e).splitlines()[0][:200]})") from None


def tokenizer_sha256(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


class VocabBridge:
    """Maps between the target's vocabulary and the drafter's.

    The intersection is by token string (``get_vocab()`` of both, added tokens included): target id
    ``t_ids[i]`` and drafter id ``d_ids[i]`` are the same string. Text crosses the other way: target ids
    are decoded (special tokens kept, no clean-up) and encoded with the drafter's tokenizer.
    """

    def __init__(self, target_tokenizer, drafter_tokenizer: Tokenizer, target_vocab_size: int | None = None):
        self.target_tokenizer, self.tokenizer = target_tokenizer, drafter_tokenizer
        tv = target_tokenizer.get_vocab()
        dv = drafter_tokenizer.get_vocab(with_added_tokens=True)
        self.target_vocab_size = int(target_vocab_size or len(tv))
        common = sorted((tv[s], dv[s]) for s in set(tv) & set(dv) if tv[s] < self.target_vocab_size)
        if not common:
            raise VocabularyError("the drafter's tokenizer shares no token string with the target's: TLI and SLEM "
                                  "need a common vocabulary (train the tokenizer with the target's pre-tokenizer)")
        self.t_ids = torch.tensor([t for t, _ in common], dtype=torch.long)
        self.d_ids = torch.tensor([d for _, d in common], dtype=torch.long)
        self.t2d = {t: d for t, d in common}
        self.d2t = {d: t for t, d in common}
        self.drafter_vocab_size = drafter_tokenizer.get_vocab_size(with_added_tokens=True)
        self._dev: dict = {}

    @property
    def size(self) -> int:
        return len(self.t2d)

    def text(self, target_ids: list[int]) -> str:
        return self.target_tokenizer.decode(target_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def drafter_ids(self, target_ids: list[int]) -> list[int]:
        """The drafter's own tokenisation of the text the target ids spell (a pure function of the ids)."""
        return self.tokenizer.encode(self.text(target_ids), add_special_tokens=False).ids

    def target_ids(self, text: str) -> list[int]:
        return list(self.target_tokenizer.encode(text, add_special_tokens=False))

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter logits [n, Vd] -> [n, V_target]: the intersection's entries, -inf everywhere else, so the
        softmax is the drafter's distribution restricted to the intersection and renormalised."""
        key = logits.device
        if key not in self._dev:
            self._dev[key] = (self.t_ids.to(key), self.d_ids.to(key))
        t, d = self._dev[key]
        out = torch.full((logits.shape[0], self.target_vocab_size), float("-inf"), dtype=logits.dtype,
                         device=logits.device)
        out[:, t] = logits[:, d]
        return out


def llama_config(target: Target, vocab_size: int, fields: dict) -> LlamaConfig:
    """The drafter's Llama config: a copy of the target's (rope, norm, activation) with the drafter's
    vocabulary and layer count; the sizes are the target's for ``init: target``, else the recipe's."""
    cfg = copy.deepcopy(target.model.config)
    if getattr(cfg, "model_type", "llama") != "llama":
        cfg = LlamaConfig(**{k: v for k, v in cfg.to_dict().items() if k in LlamaConfig().to_dict()})
    sizes = ("num_hidden_layers",) if fields.get("init") == "target" else LLAMA_FIELDS
    for k in sizes:
        if fields.get(k) is not None:
            setattr(cfg, k, int(fields[k]))
    if fields.get("init") != "target":
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        cfg.initializer_range = LlamaConfig().initializer_range  # a fresh model: the usual init, not the target's
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:1] * cfg.num_hidden_layers
    cfg.vocab_size, cfg.tie_word_embeddings = int(vocab_size), True
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = None  # set in the drafter's ids by the kind
    return cfg


@torch.no_grad()
def init_from_target(drafter: "OwnTokenizerDrafter", target: Target) -> dict:
    """Start the drafter from the target: its first layers and final norm, and an embedding row per drafter
    token: the target's row for a shared string, else the mean of the target's rows for the target's BPE
    pieces of that string (byte-level strings tokenise directly with the target's BPE model)."""
    n = drafter.model.config.num_hidden_layers
    src = target.model.get_decoder()
    if n > len(src.layers):
        raise ValueError(f"num_hidden_layers {n} > the target's {len(src.layers)} layers (init: target copies them)")
    dst = drafter.model.get_decoder()
    for i in range(n):
        dst.layers[i].load_state_dict(src.layers[i].state_dict())
    dst.norm.load_state_dict(src.norm.state_dict())
    te = target.model.get_input_embeddings().weight
    de = drafter.model.get_input_embeddings().weight
    tv = target.tokenizer.get_vocab()
    bpe = target.tokenizer.backend_tokenizer.model
    shared = pieces = 0
    for s, i in drafter.tokenizer.get_vocab(with_added_tokens=True).items():
        if s in tv and tv[s] < te.shape[0]:
            de[i] = te[tv[s]].to(de.dtype)
            shared += 1
            continue
        ids = [t.id for t in bpe.tokenize(s)] if s else []
        if ids:
            de[i] = te[ids].mean(0).to(de.dtype)
            pieces += 1
    drafter.model.tie_weights()
    return {"init": "target", "layers_from_target": n, "embedding_rows_shared": shared,
            "embedding_rows_from_pieces": pieces}


@register
class OwnTokenizerDrafter(KindBase, torch.nn.Module):
    """Registered kind ``own-tokenizer``: a small causal LM over its own BPE vocabulary.

    Needs no cached target states (it trains on text); chains only (TLI or SLEM decoding).
    """

    kind = "own-tokenizer"
    # the pipeline skips the state cache and trains it with draftsmith.drafters.own_tokenizer.training
    trains_on_text = True
    # The output head is tied to the embeddings: saved once (the checkpoint writer skips these keys and the
    # loader accepts them missing; tie_weights restores them).
    shared_with_target = ("model.lm_head",)

    config_class = OwnTokenizerModelConfig

    def __init__(self, config: OwnTokenizerModelConfig | dict, tokenizer: Tokenizer, target: Target | None = None):
        """``config``: the recipe's fields (or a checkpoint's config.json); its tokenizer fields are set from
        ``tokenizer``."""
        super().__init__()
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        self.tokenizer = tokenizer
        self.config = self.read_config(config).model_copy(
            update={"vocab_size": vocab, "tokenizer_sha256": tokenizer_sha256(tokenizer)})
        if target is None:
            raise ValueError("an own-tokenizer drafter is built for a target (its rope and norm settings)")
        self.model = LlamaForCausalLM(llama_config(target, vocab, self.config.model_dump()))
        # the target's end-of-turn tokens in the drafter's ids (an HF export stops where the target stops)
        eos = [tokenizer.token_to_id(s) for s in target_special_tokens(target.tokenizer)
               if target.tokenizer.convert_tokens_to_ids(s) in target.eos_token_ids]
        self.model.config.eos_token_id = [i for i in eos if i is not None] or None
        self.model.config.draftsmith_target_fingerprint = target.fingerprint

    def forward(self, input_ids: torch.Tensor):
        """The small LM's forward (what training calls, through accelerate's wrapper)."""
        return self.model(input_ids=input_ids)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As torch's, except that the tied head may be absent (it is the embedding matrix)."""
        res = super().load_state_dict(state_dict, strict=False, assign=assign)
        self.model.tie_weights()
        missing = [k for k in res.missing_keys if not k.startswith("model.lm_head.")]
        if strict and (missing or res.unexpected_keys):
            raise RuntimeError(f"own-tokenizer weights: missing {missing[:5]}, unexpected {res.unexpected_keys[:5]}")
        return res

    @staticmethod
    def cache_needs(config: dict) -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict, target: Target) -> "OwnTokenizerDrafter":
        raise ValueError("an own-tokenizer drafter needs its tokenizer: load it from its checkpoint directory "
                         "(from_config_dir) or build it with OwnTokenizerDrafter(config, tokenizer, target)")

    @classmethod
    def from_config_dir(cls, config: dict, target: Target, path: str | Path) -> "OwnTokenizerDrafter":
        """Rebuild from a checkpoint directory: the config plus ``tokenizer.json`` (its sha256 is checked)."""
        tok = load_tokenizer_file(Path(path) / TOKENIZER_FILE)
        want = config.get("tokenizer_sha256")
        if want and tokenizer_sha256(tok) != want:
            raise CheckpointError(f"{Path(path) / TOKENIZER_FILE}: not the tokenizer this drafter was trained with "
                                  f"(sha256 differs from config.json's tokenizer_sha256)")
        if config.get("vocab_size") not in (None, tok.get_vocab_size(with_added_tokens=True)):
            raise CheckpointError(f"{Path(path) / TOKENIZER_FILE}: {tok.get_vocab_size(with_added_tokens=True)} "
                                  f"tokens, config.json says {config['vocab_size']}")
        return cls(config, tok, target)

    def save_extra(self, path: str | Path) -> None:
        """Files written next to the weights (the checkpoint writer calls it)."""
        Path(path, TOKENIZER_FILE).write_text(self.tokenizer.to_str())

    def bridge(self, target: Target) -> VocabBridge:
        return VocabBridge(target.tokenizer, self.tokenizer, target.vocab_size)

    def decoder_drafter(self, target: Target, fingerprint: str, name: str):
        """TLI (lossless, greedy and sampling) by default; `slem_drafter` for SLEM."""
        return TLIDrafter(self.model, self.bridge(target), target_fingerprint=fingerprint, name=f"{name} TLI")

    def hf_tokenizer(self, target: Target) -> PreTrainedTokenizerFast:
        """The drafter's tokenizer as a transformers tokenizer (the chat template and special roles of the target's)."""
        tt = target.tokenizer
        kw = {r: getattr(tt, r) for r in ("eos_token", "bos_token", "pad_token", "unk_token")
              if getattr(tt, r, None) and self.tokenizer.token_to_id(getattr(tt, r)) is not None}
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(self.tokenizer.to_str()), **kw)
        if getattr(tt, "chat_template", None):
            hf.chat_template = tt.chat_template
        return hf

    def to_hf_model(self) -> LlamaForCausalLM:
        """The drafter LM (for ``draftsmith export --to hf``, which also writes `hf_tokenizer`)."""
        return self.model

    def export_hf(self, out: str | Path, target: Target) -> Path:
        """A plain HF directory (model + its own tokenizer) for
        ``generate(assistant_model=..., assistant_tokenizer=...)``."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.to_hf_model().save_pretrained(out)
        self.hf_tokenizer(target).save_pretrained(out)
        return out


def hf_assistant(path: str | Path):
    """Load an exported own-tokenizer drafter directory: (model, tokenizer) for HF universal assisted generation."""
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def describe(tok: Tokenizer, target: Target) -> dict:
    """Vocabulary facts for manifests: sizes and the intersection."""
    b = VocabBridge(target.tokenizer, tok, target.vocab_size)
    return {"drafter_vocab": b.drafter_vocab_size, "target_vocab": target.vocab_size, "intersection": b.size,
            "intersection_share_of_drafter_vocab": round(b.size / b.drafter_vocab_size, 4)}

