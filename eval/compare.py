"""The methods ``draftsmith eval`` compares: which trees each checkpoint drafts, a self-drafter's variants
(fixed lengths, full-depth verification) and its early-exit peers (ours and Hugging Face's)."""

from __future__ import annotations

from draftsmith.drafters.kangaroo.decode import early_exit_drafter
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.drafters import SelfDrafter
from draftsmith.engine.policies import FixedLength
from draftsmith.eval.bench import Method, hf_run, ours


def tree_specs_for(specs: list[str], name: str) -> list[str]:
    """The --tree specs for the checkpoint of recipe ``name``: the plain ones and its own NAME=SPEC ones."""
    out = []
    for t in specs:
        head, sep, rest = t.partition("=")
        if not sep or head.strip().startswith(("[", "{")) or "/" in head:  # a plain spec (JSON, file path)
            out.append(t)
        elif head.strip() == name:
            out.append(rest)
    return out or ["chain"]


def self_drafter_methods(target, drafter, sampling, a, trees=()) -> list:
    """Kangaroo variants of a checkpoint's drafter (fixed lengths, full-depth verification of its chain and of
    each of its ``trees`` [(spec, tree)]), or with ``drafter=None`` the early-exit peers (ours and Hugging
    Face's), as requested by the options."""
    def dec(d, policy=None, tree=None):
        return SpeculativeDecoder(target, d, policy=policy, sampling=sampling, tree=tree)

    if drafter is None:
        out = []
        if a.early_exit:
            out.append(ours(f"ours early-exit-{a.early_exit} K={a.draft_len}",
                            dec(early_exit_drafter(target, a.early_exit), FixedLength(a.draft_len))))
        if a.hf_early_exit:
            out.append(_hf_early_exit(target, a.hf_early_exit, a.draft_len, sampling))
        return out
    if not isinstance(drafter, SelfDrafter):
        return []
    out = [ours(f"ours {drafter.name} K={k}", dec(drafter, FixedLength(k))) for k in a.fixed_len]
    if a.full_verify:
        out.append(ours(f"ours {drafter.name} full-verify", dec(drafter.variant(full_verify=True))))
        out += [ours(f"ours {drafter.name} {spec} full-verify", dec(drafter.variant(full_verify=True), tree=tree))
                for spec, tree in trees if tree is not None]
    return out


def _hf_early_exit(target, exit_layer: int, k: int, sampling) -> Method:
    """HF assisted generation drafting with the target's own first layers (constant k drafts).

    HF drafts by calling the same model with ``config.num_hidden_layers`` lowered, so those calls
    are subtracted from the forward count: tau counts full-depth forwards only, as for ours."""
    model = target.model
    full = int(model.config.num_hidden_layers)
    inner = hf_run(target, sampling, {"assistant_early_exit": exit_layer, "num_assistant_tokens": k,
                                     "num_assistant_tokens_schedule": "constant",
                                     "assistant_confidence_threshold": 0.0})

    def run(ids, n, seed):
        drafts = [0]

        def hook(module, args):
            drafts[0] += int(model.config.num_hidden_layers) != full

        h = model.register_forward_pre_hook(hook)
        try:
            r = inner(ids, n, seed)
        finally:
            h.remove()
        r.counted_forwards -= drafts[0]
        return r

    return Method(f"HF early-exit-{exit_layer} K={k}", run, "hf")
