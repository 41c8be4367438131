"""The one decoder layer the kinds share (draftsmith.common.layers.DecoderLayer): it is the target's own layer when
given its weights, each kind runs it, and checkpoints written with the kinds' earlier parameter names load."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.checkpoint import load_checkpoint, save_checkpoint
from draftsmith.common.layers import DecoderLayer
from draftsmith.drafters.eagle3.model import Eagle3Module
from draftsmith.drafters.kangaroo.model import KangarooAdapter
from draftsmith.heads.hydra.model import HydraHeads
from tests.families import off_initial
from tests.tiny import make_tiny_target


@pytest.fixture(scope="module")
def tgt():
    return make_tiny_target(vocab_size=48, seed=3, init_std=0.3, layers=4, heads=4, kv_heads=2)


def _layer_type(model, index: int) -> dict:
    """{"layer_type": ...} where each layer type has a RoPE of its own (Gemma 3), else {}."""
    types = getattr(model.config, "layer_types", None)
    return {"layer_type": types[index]} if types and hasattr(model.model.rotary_emb, f"{types[index]}_inv_freq") else {}


def _layer_like(model, index: int, **traits) -> DecoderLayer:
    """The shared layer with the shape, RoPE and weights (outputs included) of ``model``'s layer ``index``."""
    body, c = model.model, model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    lt = _layer_type(model, index).get("layer_type")
    rot = body.rotary_emb
    inv, scale = ((getattr(rot, f"{lt}_inv_freq"), getattr(rot, f"{lt}_attention_scaling")) if lt
                  else (rot.inv_freq, rot.attention_scaling))
    lay = DecoderLayer(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, hd, c.intermediate_size,
                       c.rms_norm_eps, inv_freq=inv, rope_scale=scale, **traits)
    lay.init_from(body.layers[index], outputs=True)
    return lay


@torch.no_grad()
def _both(model, index: int, lay: DecoderLayer, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the shared layer's output, the model's own layer ``index``'s) over one causal sequence of T random states."""
    body = model.model
    x = torch.randn(1, T, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(T)
    rope = body.rotary_emb(x, pos[None], **_layer_type(model, index))
    ref = body.layers[index](x, position_ids=pos[None], position_embeddings=rope)
    ref = ref[0] if isinstance(ref, tuple) else ref
    q, k, v = lay.qkv(lay.attention_input(x[0]), pos)
    return lay.finish(x[0], lay.attend(q, k, v, torch.ones(T, T, dtype=torch.bool).tril())), ref[0]


def test_the_layer_with_the_targets_weights_is_the_targets_layer(tgt):
    """Given a target layer's weights (outputs included) and the target's RoPE, the shared layer computes what the
    target's own decoder layer does, causally over a sequence: the kinds' layers are Llama layers."""
    mine, ref = _both(tgt.model, 1, _layer_like(tgt.model, 1), 9, 0)
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
    other, _ = _both(tgt.model, 1, _layer_like(tgt.model, 2), 9, 0)  # the test can fail: another layer's weights
    assert not torch.allclose(other, ref, atol=1e-3)


def _family_model(family: str):
    """A tiny random model of ``family`` (q/k/v biases for qwen2, q/k norms for qwen3, o-bias llama)."""
    import transformers
    common = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3)
    cfg = {"llama-bias": lambda: transformers.LlamaConfig(attention_bias=True, **common),
           "mistral": lambda: transformers.MistralConfig(**common),
           "qwen2": lambda: transformers.Qwen2Config(**common),
           "qwen3": lambda: transformers.Qwen3Config(head_dim=8, **common),
           # query_pre_attn_scalar other than head_dim, so that the score scale matters
           "gemma3": lambda: transformers.Gemma3TextConfig(head_dim=8, query_pre_attn_scalar=24, sliding_window=4,
                                                          layer_types=["sliding_attention", "full_attention"],
                                                          **common)}[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    off_initial(model)  # biases and norms away from their initial values, so that copying them matters
    return model


@pytest.mark.parametrize("family", ["llama-bias", "mistral", "qwen2", "qwen3", "gemma3"])
def test_the_layer_is_each_known_familys_layer(family):
    """The traits read from the target's config (`LayerTraits`: biases, per-head q/k norms, Gemma 3's offset and
    sandwich norms, score scale and GELU) make the shared layer the family's own layer, given its weights (Gemma 3:
    a sliding layer and a full one, each with its RoPE)."""
    from types import SimpleNamespace

    from draftsmith.schema import LayerTraits
    model = _family_model(family)
    traits = LayerTraits.traits(SimpleNamespace(model=model))
    assert traits["qkv_bias"] == (family in ("llama-bias", "qwen2"))
    assert traits["qk_norm"] == (family in ("qwen3", "gemma3"))
    assert traits.get("sandwich_norms", False) == (family == "gemma3")
    for index in (0, 1) if family == "gemma3" else (0,):
        mine, ref = _both(model, index, _layer_like(model, index, **traits), 7, 1)
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
    if any(traits.values()):  # the traits matter: a Llama layer with the same weights computes another function
        plain, _ = _both(model, 0, _layer_like(model, 0), 7, 1)
        assert not torch.allclose(plain, ref, atol=1e-3)
    if family == "gemma3":  # and each of Gemma's matters on its own
        for name, llama_value in (("norm_offset", False), ("sandwich_norms", False), ("query_scale", None),
                                  ("activation", "silu")):
            one_off, _ = _both(model, 1, _layer_like(model, 1, **{**traits, name: llama_value}), 7, 1)
            assert not torch.allclose(one_off, ref, atol=1e-4), name


def test_an_unknown_layer_type_is_refused_by_name():
    from types import SimpleNamespace

    from draftsmith.schema import LayerTraits
    cfg = SimpleNamespace(model_type="phi3")
    with pytest.raises(ValueError, match="'phi3'"):
        LayerTraits.traits(SimpleNamespace(model=SimpleNamespace(config=cfg)))
    softcap = SimpleNamespace(model_type="gemma3_text", attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        LayerTraits.traits(SimpleNamespace(model=SimpleNamespace(config=softcap)))


def test_every_kind_with_a_layer_runs_the_shared_one(tgt):
    hydra = HydraHeads.for_target(tgt, num_heads=2, prefix_layer=True)
    kangaroo = KangarooAdapter.for_target(tgt, exit_layer=1, adapter_mlp=True)
    eagle = Eagle3Module.for_target(tgt, aux_layers=[1, 2, 3], vocab_keep=16)
    for layer in (hydra.prefix, kangaroo.layer):
        assert isinstance(layer, DecoderLayer) and layer.inputs == 1
    assert isinstance(eagle.layer, DecoderLayer) and eagle.layer.inputs == 2


@pytest.mark.parametrize("kind", ["hydra++", "kangaroo"])
def test_checkpoints_with_the_earlier_parameter_names_load(tgt, tmp_path, kind):
    """Hydra++'s prefix layer had norm1/norm2, Kangaroo's adapter its q, k, v, o, norm1, norm_mlp, gate, up, down at
    the top level: such a checkpoint loads into the shared layer with the same weights."""
    if kind == "hydra++":
        m = HydraHeads.for_target(tgt, num_heads=2, prefix_layer=True)
        old = {"prefix.input_norm.": "prefix.norm1.", "prefix.post_norm.": "prefix.norm2."}
    else:
        m = KangarooAdapter.for_target(tgt, exit_layer=1, adapter_mlp=True)
        old = {**{f"layer.{n}.": f"{n}." for n in ("q", "k", "v", "o", "gate", "up", "down")},
               "layer.input_norm.": "norm1.", "layer.post_norm.": "norm_mlp."}
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    save_checkpoint(tmp_path / "c", m, tgt)
    f = tmp_path / "c" / "model.safetensors"
    sd = load_file(f)
    renamed = {}
    for key, t in sd.items():
        new = next((old[p] + key[len(p):] for p in old if key.startswith(p)), key)
        renamed[new] = t
    assert set(renamed) != set(sd)  # the file now holds the earlier names
    save_file(renamed, f)
    back = load_checkpoint(tmp_path / "c", tgt)
    back = back[0] if isinstance(back, tuple) else back
    got, want = back.state_dict(), m.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_kinds_build_their_layer_like_the_targets(family):
    """Kangaroo's adapter and Hydra++'s prefix layer on a Qwen target: built with its traits (read from its config,
    written to config.json) and initialised with its layer's biases and q/k norms."""
    from pathlib import Path

    from draftsmith.target import Target, fingerprint
    from tests.tiny import make_tokenizer
    model, tok = _family_model(family), make_tokenizer(48)
    t = Target(model=model, tokenizer=tok, name=family, path=Path(f"<{family}>"), fingerprint=fingerprint(model, tok))
    kan = KangarooAdapter.for_target(t, exit_layer=1)
    hyd = HydraHeads.for_target(t, num_heads=2, prefix_layer=True)
    for layer, src, cfg in ((kan.layer, model.model.layers[1], kan.config),
                            (hyd.prefix, model.model.layers[-1], hyd.config.prefix)):
        assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family in ("qwen3", "gemma3"))
        if family == "qwen2":
            assert torch.equal(layer.q.bias, src.self_attn.q_proj.bias.float())
        else:
            assert torch.equal(layer.k_norm.weight, src.self_attn.k_norm.weight.float())
        if family == "gemma3":
            assert cfg.sandwich_norms and cfg.norm_offset and cfg.activation == "gelu_tanh"
            if layer.mlp:  # Kangaroo's adapter has none by default
                assert torch.equal(layer.post_norm.weight, src.pre_feedforward_layernorm.weight.float())
            # it starts as the identity through its output norms' zero scales (1 + weight), its projections random
            assert torch.all(layer.attn_out_norm.weight == -1) and layer.o.weight.abs().sum() > 0
    assert torch.equal(kan.norm_out.weight, model.model.norm.weight.float()) and kan.norm_out.offset == (
        family == "gemma3")


def test_a_sandwich_layer_starts_as_the_identity_and_grows_smoothly():
    """With sandwich norms (Gemma 3) a layer that starts as the identity does so through its output norms' scales,
    not zero projections: a norm of a zero output would pass the first small update at full scale (its gradient
    at 0 is 1/sqrt(eps)), which is what made a Gemma Hydra++ prefix layer's loss jump into the thousands. One small
    step moves the output a little (the test can fail: with zero projections instead, it moves 5000 times more)."""
    torch.manual_seed(0)
    traits = dict(qk_norm=True, norm_offset=True, sandwich_norms=True, query_scale=0.2, activation="gelu_tanh")
    lay = DecoderLayer(32, 4, 2, 8, 64, 1e-6, zero_outputs=True, **traits)
    x = torch.randn(6, 32) * 30  # Gemma's residual stream is large
    pos = torch.arange(6)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()

    def run(layer):
        q, k, v = layer.qkv(layer.attention_input(x), pos)
        return layer.finish(x, layer.attend(q, k, v, mask))

    torch.testing.assert_close(run(lay), x)
    run(lay).pow(2).sum().backward()
    with torch.no_grad():
        for p in lay.parameters():
            if p.grad is not None:
                p -= 1e-4 * p.grad.sign()  # one small sign step (Adam's first step has this size)
    moved = (run(lay) - x).abs().max().item()
    assert 0 < moved < 1e-2  # 3.4e-4 here; with zero projections and unit output scales instead, 1.65
