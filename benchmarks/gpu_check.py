"""One prepared check of draftsmith on a GPU: losslessness on CUDA, step costs as a simulator profile, training.

Run it where a GPU is lent (``bash scripts/gpu_check.sh OUT``), or here first (``python -m benchmarks.gpu_check
--device cpu --quick --out DIR``). Every case is recorded, failures with their error, and the run goes on:

  * ``exact``: the decoder's exact output distribution (every draft draw and acceptance branch enumerated,
    `draftsmith.eval.exact`) for every drafter with a decoder adapter (each trained kind built with random
    weights through the registry, pruned vocabularies and RDK, and the decoder-only drafters: first-layers,
    early exit, SuffixDecoding, prompt lookup), in chains, static trees and dynamic trees, at T=0.8, with
    top-k/top-p and greedy; on a tiny float64 model (reference: cache-free forwards of the target, TV < 1e-9,
    and the forwards' own rows) and on the same tiny model in bf16 (reference: the rows the verification
    forwards computed, docs/methods.md §16). Medusa's typical acceptance is run too and must be caught. Then
    Monte Carlo chi-square on the same model, and the enumeration through the compiled forward.
  * ``shape``: a random model of the default target's exact shape (SmolLM2-135M: 30 layers, 576 wide,
    49152 ids), fp32 and bf16: exact enumeration under top-k 3, Monte Carlo chi-square, greedy equality with
    plain decoding.
  * ``families``: each model family's tiny random target (tests/families.py: Llama, Mistral with and without a
    window, Qwen2, Qwen3, Gemma 3 with sliding layers) on the device in float32: plain decoding and every kind,
    chains and a tree, give the model's own greedy tokens (or the kind is refused by name); Gemma 3 without its
    windows must differ (negative control); the batched decoder past the window.
  * ``costs``: the target's forward by rows x context (the model's own forward, and our static-shape one,
    which the profile holds) and each recipe's drafter cost fitted from real decoding runs
    (`draftsmith.sim.calibrate`), written as a ``draftsmith simulate`` profile.
  * ``train``: each recipe's drafter trained for a few steps on a cache of random sequences written by the
    default-shape model: positions/s and peak memory.
  * ``launch``: one ``accelerate launch -m draftsmith.cli train`` on the default-shape model saved as a local
    model directory.
  * ``graphs``: our static-shape forward replayed as CUDA graphs beside the same forward run eagerly (last: a
    failed capture can spoil the process's CUDA generator).

Writes OUT/gpu_check.json (after every case, so a run cut short keeps what it did) and
OUT/gpu_profile_<dtype>.yaml, and prints a summary last. ``--previous OLD.json`` takes the cases an earlier run
passed (or found not applicable) and runs the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

from draftsmith import registry
from draftsmith.engine.capabilities import capabilities
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.trees import DynamicTree
from draftsmith.eval.exact import (exact_distribution, forwards_distribution, record_forwards, target_distribution,
                                   total_variation)
from draftsmith.target import Target, fingerprint

SECTIONS = ("exact", "shape", "families", "costs", "train", "launch", "graphs")
# SmolLM2-135M-Instruct's architecture (the default target), with random weights
DEFAULT_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
STATIC = [(0,), (1,), (0, 0)]
MODES = {"chain": dict(policy=FixedLength(2)), "static": dict(tree=STATIC),
         "dynamic": dict(tree=DynamicTree(budget=3, max_depth=2, width=2, expand_batch=1))}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------------------------ the report
class Check:
    """Cases by section, each with a status (pass, fail, error, n/a, skipped), its figures and seconds; the JSON
    is rewritten after every case. ``budget_s`` bounds the whole run: a section whose share is spent skips the
    rest of its cases (recorded as skipped, not run)."""

    SHARES = {"exact": 0.2, "shape": 0.22, "families": 0.05, "costs": 0.28, "train": 0.15, "launch": 0.08,
              "graphs": 0.07}

    def __init__(self, out: Path, budget_s: float, device: str, previous: Path | None = None):
        self.out, self.budget_s, self.t0 = out, budget_s, time.perf_counter()
        self.data: dict = {"device": device, "budget_s": budget_s, "cases": [], "sections": {}}
        # a rerun: cases an earlier run (its JSON) passed or found not applicable are taken from it, not run again
        self.previous: dict = {}
        if previous is not None:
            prev = json.loads(Path(previous).read_text())
            self.data["previous_run"] = {"file": str(previous), "env": prev.get("env"), "command": prev.get("command")}
            self.previous = {c["name"]: c for c in prev["cases"] if c["status"] in ("pass", "n/a")}
        self.section = ""
        self.section_end = math.inf
        out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def begin(self, section: str, remaining: list[str]) -> None:
        """Start a section: it may use its share of what is left, in proportion to the sections still to run."""
        left = self.budget_s - self.elapsed()
        share = self.SHARES[section] / sum(self.SHARES[s] for s in remaining)
        self.section, self.section_end = section, self.elapsed() + max(0.0, left) * share
        self.data["sections"][section] = {"started_s": round(self.elapsed(), 1), "allowed_s": round(left * share, 1)}
        print(f"\n== {section} (up to {left * share:.0f} s)", flush=True)

    def end(self) -> None:
        self.data["sections"][self.section]["took_s"] = round(
            self.elapsed() - self.data["sections"][self.section]["started_s"], 1)
        self.save()

    def reused(self, name: str) -> dict | None:
        """The earlier run's record of a case this run took from it (None when it ran or was skipped here)."""
        return self.previous.get(name)

    def time_left(self) -> float:
        return self.section_end - self.elapsed()

    @contextmanager
    def case(self, name: str, need_s: float = 0.0, force: bool = False, rerun: bool = False, **info):
        """Record one case: the body fills the yielded dict (``status`` defaults to pass when it returns, error
        when it raises; ``ok`` False makes it a fail). A case with no time left is skipped (the body gets None),
        unless ``force``; one an earlier run passed is taken from it (the body gets None), unless ``rerun``."""
        rec = {"section": self.section, "name": name, **info}
        if name in self.previous and not (force or rerun):
            self._add({**self.previous[name], "from_previous_run": True})
            yield None
            return
        if not force and (self.time_left() < need_s or self.time_left() <= 0):
            rec.update(status="skipped", why=f"section time spent ({self.time_left():.0f} s left, needs {need_s:.0f})")
            self._add(rec)
            yield None
            return
        t0 = time.perf_counter()
        try:
            yield rec
            if "status" not in rec:
                rec["status"] = "pass" if rec.get("ok", True) else "fail"
        except NotApplicable as e:
            rec.update(status="n/a", why=str(e))
        except Exception as e:  # noqa: BLE001 -- every failure is recorded and the check goes on
            rec.update(status="error", error=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc(limit=-6))
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        self._add(rec)

    def _add(self, rec: dict) -> None:
        self.data["cases"].append(rec)
        figs = {k: v for k, v in rec.items() if k not in ("section", "name", "status", "traceback", "seconds", "ok")}
        short = ", ".join(f"{k}={_fmt(v)}" for k, v in figs.items() if not isinstance(v, (dict, list)))
        print(f"  [{rec['status']:>7}] {rec['name']}  {short[:220]}", flush=True)
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.out / "gpu_check.json")


class NotApplicable(Exception):
    """The combination does not exist (a chain-only drafter asked for a tree): n/a, not a failure."""


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


# ------------------------------------------------------------------------------------------------ models
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def tiny_target(dev: torch.device, dtype: torch.dtype) -> Target:
    """The exact-enumeration target of the test suite: 6 ids (EOS among them), 4 layers, peaky random weights."""
    from tests.tiny import make_tiny_target
    t = make_tiny_target(vocab_size=6, seed=0, init_std=0.5, layers=4)
    t.model.to(device=dev, dtype=dtype)
    return t


def shape_target(dev: torch.device, dtype: torch.dtype, layers: int | None = None, seed: int = 0,
                 embed_std: float = 0.1) -> Target:
    """A random model of the default target's exact shape (``layers`` fewer for a quick CPU run). The tied
    embeddings get std ``embed_std`` (not the usual 0.02) so that next-token distributions are peaked as a
    trained model's are: with near-uniform ones over 49152 ids, top-k cells would be near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny import make_tokenizer
    cfg = dict(DEFAULT_SHAPE)
    if layers:
        cfg["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg, initializer_range=0.02)).eval().requires_grad_(False)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, embed_std)
    model.to(device=dev, dtype=dtype)
    tok = make_tokenizer(96)
    return Target(model=model, tokenizer=tok, name="smollm2-135m-shape-random", path=Path("<random-default-shape>"),
                  fingerprint=fingerprint(model, tok))


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.5) -> None:
    """Every trainable matrix random (fan-in scaled), so that every path through the drafter matters."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, std * 3 / p.shape[1] ** 0.5)


def _kind(target: Target, kind: str, seed: int, keep: int | None = None, randomize: bool = True, **fields):
    """A registered kind's module for ``target`` (random weights), pruned to ``keep`` ids when given, on the
    target's device and dtype, as the decoder's drafter."""
    p = next(target.model.parameters())
    m = registry.get(kind).for_target(target, **({"vocab_keep": keep} if keep else {}), **fields)
    if randomize:
        _randomize(m, seed)
    if keep:
        g = torch.Generator().manual_seed(seed)
        m.set_draft_vocab(torch.randperm(target.vocab_size, generator=g)[:keep].sort().values)
    m = m.to(device=p.device, dtype=p.dtype).eval()
    return m


def drafters(target: Target, which: list[str] | None = None) -> dict:
    """Every decoder drafter, by name: name -> builder() (built lazily, so one that fails is one failed case)."""
    from draftsmith.drafters.kangaroo.decode import early_exit_drafter
    from draftsmith.drafters.suffix.drafter import PromptLookupDrafter, SuffixDrafter
    from draftsmith.drafters.suffix.index import SuffixConfig, SuffixIndex

    L = int(target.config.num_hidden_layers)
    V = target.vocab_size
    keep = max(4, V // 6) if V > 6 else 4  # tiny: 4 of 6 ids; default shape: 8192 of 49152, as the recipes
    aux = [1, L // 2, L - 1] if L >= 4 else [0, 1, L - 1]

    def fp(m, name, **kw):
        return m.decoder_drafter(target, target.fingerprint, name, **kw)

    def suffix():
        cfg = SuffixConfig(max_spec_factor=3, min_token_prob=0.05, tree=True)
        g = SuffixIndex(cfg)
        plain = SpeculativeDecoder(target, sampling=SamplingParams(1.0))
        for i in range(6):  # the target's own sampled answers: drafts often, not always, accepted
            g.add_response(plain.generate([1, 3, 4, 3], 6, seed=100 + i).tokens)
        return SuffixDrafter(cfg, g)

    def own_tokenizer():
        from draftsmith.drafters.own_tokenizer.decode import TLIDrafter
        from draftsmith.drafters.own_tokenizer.model import VocabBridge
        from tests.test_own_tokenizer import hand_tokenizer
        from tests.tiny import make_tiny_model
        tk = hand_tokenizer()
        m = make_tiny_model(vocab_size=tk.get_vocab_size(), seed=7, init_std=0.5, layers=1)
        p = next(target.model.parameters())
        m.to(device=p.device, dtype=p.dtype)
        return TLIDrafter(m, VocabBridge(target.tokenizer, tk, V), target.fingerprint, "own-tokenizer TLI")

    def standalone_rdk():
        m = _kind(target, "standalone", 5, keep=keep, randomize=True, init="scratch", num_layers=1, rdk=True)
        kept = m.draft_head.kept_ids.cpu()
        pruned = [i for i in range(V) if i not in set(kept.tolist())][:2]
        parent = torch.full((V,), -1, dtype=torch.long)
        weight = torch.zeros(V)
        for j, i in enumerate(pruned):  # a fixed, non-trivial affinity: pruned ids attached to a kept id
            parent[i], weight[i] = int(kept[0]), 0.3 - 0.1 * j
        m.rdk.set(kept, parent, weight)
        return fp(m.to(next(target.model.parameters()).device), "standalone-rdk")

    out = {
        "medusa": lambda: fp(_kind(target, "medusa", 3, num_heads=2, num_layers=1), "medusa"),
        "medusa-pruned": lambda: fp(_kind(target, "medusa", 3, keep=keep, num_heads=2, num_layers=1), "medusa"),
        "hydra": lambda: fp(_kind(target, "hydra", 4, num_heads=2, num_layers=1), "hydra"),
        "hydra++": lambda: fp(_kind(target, "hydra", 4, keep=keep, num_heads=2, num_layers=2, prefix_layer=True),
                              "hydra++"),
        "kangaroo": lambda: fp(_kind(target, "kangaroo", 6, exit_layer=1, adapter_mlp=True), "kangaroo"),
        "kangaroo-pruned": lambda: fp(_kind(target, "kangaroo", 6, keep=keep, exit_layer=1), "kangaroo"),
        "standalone": lambda: fp(_kind(target, "standalone", 5, randomize=False, init="target", num_layers=1),
                                 "standalone"),
        "standalone-rdk": standalone_rdk,
        "eagle3": lambda: fp(_kind(target, "eagle3", 1, keep=keep, aux_layers=aux), "eagle3"),
        "own-tokenizer": own_tokenizer,
        "first-layers:1": lambda: first_layers_drafter(target, 1),
        "early-exit:1": lambda: early_exit_drafter(target, 1),
        "suffix": suffix,
        "prompt-lookup": lambda: PromptLookupDrafter(k=2, max_ngram=2),
    }
    return {k: v for k, v in out.items() if which is None or k in which}


def decoder(target: Target, drafter, mode: str, sampling: SamplingParams, acceptance: str = "exact"):
    kw = dict(MODES[mode])
    try:
        return SpeculativeDecoder(target, drafter, sampling=sampling, acceptance=acceptance, **kw)
    except ValueError as e:
        if "chains only" in str(e) or "not supported" in str(e):
            raise NotApplicable(str(e)) from None
        raise


# ------------------------------------------------------------------------------------------------ losslessness
def _bound(spread: float, n_new: int, temperature: float) -> float:
    """TV the forwards' own disagreement allows (tests/test_dtype.py): n positions, each within e^(2 eps/T) - 1."""
    if spread == 0.0:
        return 1e-9
    if temperature == 0.0:
        return math.inf  # greedy with disagreeing rows: the reference is ambiguous (reported, not judged)
    return 1e-9 + 2 * n_new * (math.exp(2 * spread / temperature) - 1)


@torch.no_grad()
def enumerate_case(target: Target, dec, prompt: list[int], n_new: int, cache_free_ref: dict | None) -> dict:
    """The decoder's exact distribution against (a) the distribution of the rows its own verification forwards
    computed (lossless in the forward's dtype: within the rounding bound of their disagreement) and (b) when
    given, the cache-free float64 reference (TV < 1e-9 on CPU; a GPU's float64 kernels may sum in another
    order, so < 1e-6 there, three orders under what a lossy rule gives)."""
    rows = record_forwards(dec)
    got = exact_distribution(dec, prompt, n_new)
    s = dec.sampling
    # the reference's probabilities computed on the decoder's device, from the rows its forwards computed
    rows_here = {k: [r.to(dec.device) for r in v] for k, v in rows.items()}
    ref, spread, missing = forwards_distribution(
        rows_here, prompt, n_new, s, dec.eos,
        lambda seq: target.model(torch.tensor([list(seq)], device=dec.device)).logits[0, -1])
    tv_own = total_variation(got, ref)
    bound = _bound(spread, n_new, s.temperature)
    # Probabilities in float32 (every dtype but float64; `record_forwards` also keeps a float64 model's rows in
    # float32) round by the kernel that computes them: on an H100 the host's softmax against the device's gave
    # TV 1.7e-8 on bf16 rows (run 1, docs/results-log.md §23), on the device 1.3e-16; float32-kept float64 rows 6.5e-8.
    # 1e-6 bounds such rounding, three orders under what a lossy rule gives (> 1e-3).
    bound = max(bound, 1e-6)
    out = {"outcomes": len(got), "mass": round(sum(got.values()), 12), "tv_own": tv_own, "bound": bound,
           "spread": spread, "missing": missing, "forward_rows": sum(len(v) for v in rows.values())}
    ok = abs(sum(got.values()) - 1) < 1e-9 and missing == 0 and tv_own <= bound
    if cache_free_ref is not None:
        out["tv_cache_free"] = total_variation(got, cache_free_ref)
        ok = ok and out["tv_cache_free"] < (1e-9 if dec.device.type == "cpu" else 1e-6)
    out["ok"] = ok
    return out


class Lazy:
    """Targets and drafters by key, built on first use (one that fails to build fails the cases that need it)."""

    def __init__(self):
        self.made: dict = {}

    def get(self, key, build):
        if key not in self.made:
            self.made[key] = build()
        return self.made[key]


def section_exact(ck: Check, dev: torch.device, quick: bool, dtypes: list[str]) -> None:
    """Exact enumeration on the tiny model, in tiers so that a short budget still covers every drafter: (1) every
    drafter in every mode at T=0.8 in the first dtype, (2) every drafter's chain and the head kinds' trees in the
    others, (3) greedy and top-k/top-p; then Monte Carlo chi-square on the same model, and the compiled forward."""
    prompt, n_new = [1, 3, 4, 3], 3
    samplings = {"T0.8": SamplingParams(0.8), "topk4-topp0.95": SamplingParams(1.0, top_k=4, top_p=0.95),
                 "greedy": SamplingParams(0.0)}
    if not dtypes:
        return
    names = list(drafters(tiny_target(torch.device("cpu"), torch.float32)))
    first, rest = dtypes[0], dtypes[1:]
    plan = [(first, n, m, "T0.8") for n in names for m in MODES] + [(first, "typical", "static", "T0.8")]
    for d in rest:
        plan += [(d, n, "chain", "T0.8") for n in names]
        plan += [(d, n, m, "T0.8") for n in ("medusa", "hydra++", "eagle3") for m in ("static", "dynamic")]
        plan += [(d, "typical", "static", "T0.8")]
    for d in dtypes:
        plan += [(d, n, "chain", "greedy") for n in names]
        plan += [(d, n, m, "greedy") for n in ("medusa-pruned", "eagle3") for m in ("static", "dynamic")]
        plan += [(d, n, "chain", "topk4-topp0.95") for n in ("medusa-pruned", "eagle3", "standalone-rdk",
                                                             "own-tokenizer", "suffix", "kangaroo")]
        plan += [(d, n, m, "topk4-topp0.95") for n in ("hydra++", "eagle3") for m in ("static", "dynamic")]
    if quick:
        plan = [p for p in plan if p[3] == "T0.8" and p[1] in ("medusa", "hydra++", "eagle3", "suffix", "typical")]
        plan = plan[:8] + [p for p in plan if p[1] == "typical"]
    targets, refs, built = Lazy(), {}, Lazy()
    for dname, name, mode, sname in plan:
        control = name == "typical"  # Medusa's typical acceptance: lossy at T > 0, and must be caught
        title = (f"exact {dname} typical-acceptance is caught (negative control)" if control
                 else f"exact {dname} {name} {mode} {sname}")
        with ck.case(title, kind="medusa" if control else name, mode=mode, sampling=sname, dtype=dname) as rec:
            if rec is None:
                continue
            target = targets.get(dname, lambda: tiny_target(dev, DTYPES[dname]))
            ref = None
            if DTYPES[dname] == torch.float64:
                if (dname, sname) not in refs:
                    s = samplings[sname]
                    refs[(dname, sname)] = target_distribution(target, prompt, n_new, s.temperature, s.top_k, s.top_p)
                ref = refs[(dname, sname)]
            builders = drafters(target)
            d = built.get((dname, "medusa" if control else name), builders["medusa" if control else name])
            dec = decoder(target, d, mode, samplings[sname], acceptance="typical" if control else "exact")
            r = enumerate_case(target, dec, prompt, n_new, ref)
            if control:
                rec.update({k: v for k, v in r.items() if k != "ok"})
                rec["ok"] = not r["ok"] and r["tv_own"] > 1e-3
            else:
                rec.update(r)
    # Monte Carlo on the tiny model too: the sampling path end to end (the decoder's own random draws), chi-square
    from draftsmith.eval.mc_lossless import mc_lossless
    mc_plan = [("medusa", "static"), ("eagle3", "dynamic"), ("standalone-rdk", "chain"), ("suffix", "static")]
    for dname in dtypes:
        for name, mode in mc_plan[:1] if quick else mc_plan:
            n_mc = 200 if quick else 600
            with ck.case(f"exact {dname} Monte Carlo T0.8 {name} {mode} ({n_mc} samples)", kind=name, mode=mode,
                         sampling="T0.8", dtype=dname, need_s=10) as rec:
                if rec is None:
                    continue
                target = targets.get(dname, lambda: tiny_target(dev, DTYPES[dname]))
                d = built.get((dname, name), drafters(target)[name])
                r = mc_lossless(decoder(target, d, mode, samplings["T0.8"]), prompt, n_new, n_mc, seed=0)
                rec.update(r)
                rec["ok"] = r["p_value"] > 1e-3 and r["drafted"] > 0
    # the decoders' default forward (`--forward compile`, inductor) on this device, losslessness through it
    with ck.case(f"exact {dtypes[0]} compiled forward: medusa static T0.8", kind="medusa", mode="static",
                 sampling="T0.8", dtype=dtypes[0], forward="compile", need_s=30) as rec:
        if rec is not None:
            target = tiny_target(dev, DTYPES[dtypes[0]])
            use_fast_forward(target, "compile", autotune=False)
            dec = decoder(target, drafters(target)["medusa"](), "static", samplings["T0.8"])
            ref = refs.get((dtypes[0], "T0.8"))
            t0 = time.perf_counter()
            rec.update(enumerate_case(target, dec, prompt, n_new, ref), compile_s=target.fast_body.compile_s)
            rec["compiled_used"] = dec.fast is target.fast_body and bool(target.fast_body._seen)
            rec["enumerate_s"] = time.perf_counter() - t0
            if ref is not None:  # compiled norms round like fp32 ones (tests/test_decoder_enumeration.py): 8.7e-7
                # measured on an AVX2 EPYC; 1e-5 is two orders under what a lossy rule gives (> 1e-3)
                rec["ok"] = rec["tv_own"] <= rec["bound"] and rec["tv_cache_free"] < 1e-5 and rec["compiled_used"]
            else:
                rec["ok"] = rec["ok"] and rec["compiled_used"]


def section_shape(ck: Check, dev: torch.device, quick: bool, dtypes: list[str], samples: int) -> None:
    """The default target's shape, random weights: exact enumeration under top-k 3 (27 outcomes of 3 tokens),
    Monte Carlo chi-square at T=0.8, greedy equality; in tiers across the dtypes."""
    from draftsmith.eval.mc_lossless import mc_lossless

    layers = 4 if quick else None
    prompt = [1, 40, 41, 42, 43, 44, 45, 1, 46]  # any ids: the tokenizer is a stand-in
    names = ["medusa", "hydra++", "eagle3", "first-layers:1", "standalone", "kangaroo", "suffix"]
    enum1 = [("medusa", "dynamic"), ("hydra++", "static"), ("eagle3", "chain")]
    enum2 = [("eagle3", "static"), ("first-layers:1", "chain"), ("kangaroo", "chain"), ("standalone", "static"),
             ("suffix", "chain")]
    mc = [("first-layers:1", "chain"), ("eagle3", "dynamic"), ("hydra++", "static")]
    plan = []
    for d in dtypes:
        plan += [(d, "exact", n, m) for n, m in enum1] + [(d, "mc", n, m) for n, m in mc[:2]] + [(d, "greedy", "", "")]
    for d in dtypes:
        plan += [(d, "exact", n, m) for n, m in enum2] + [(d, "mc", n, m) for n, m in mc[2:]]
    if quick:
        plan = [p for p in plan if p in [(dtypes[0], "exact", *enum1[0]), (dtypes[0], "mc", *mc[0]),
                                         (dtypes[-1], "greedy", "", "")]]
    targets, built = Lazy(), Lazy()
    topk = SamplingParams(1.0, top_k=3)
    n_mc = 60 if quick else samples
    for dname, what, name, mode in plan:
        title = {"exact": f"shape {dname} exact top-k3 {name} {mode}", "mc": f"shape {dname} Monte Carlo T0.8 "
                 f"{name} {mode} ({n_mc} samples)", "greedy": f"shape {dname} greedy equality with plain decoding"}
        with ck.case(title[what], kind=name or None, mode=mode or None, dtype=dname, need_s=5) as rec:
            if rec is None:
                continue
            target = targets.get(dname, lambda: shape_target(dev, DTYPES[dname], layers=layers))
            builders = drafters(target, names)
            if what == "exact":
                dec = decoder(target, built.get((dname, name), builders[name]), mode, topk)
                rec.update(enumerate_case(target, dec, prompt, 3, None))
            elif what == "mc":
                dec = decoder(target, built.get((dname, name), builders[name]), mode, SamplingParams(0.8))
                r = mc_lossless(dec, prompt, 3, n_mc, seed=0)
                rec.update(r)
                rec["ok"] = r["p_value"] > 1e-3 and r["drafted"] > 0
            else:
                rec.update(greedy_cases(target, {k: built.get((dname, k), builders[k]) for k in names}, prompt,
                                           24 if quick else 48))
    del targets, built
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def greedy_cases(target: Target, drafters_by_name: dict, prompt: list[int], n_new: int) -> dict:
    """Greedy speculative decoding against plain greedy decoding, per drafter and mode
    (`draftsmith.eval.greedy_equality`): equal tokens, or a divergence where plain decoding's top-2 gap is a tie
    that rounding decides (4 units in the last place of the top logit in the model's dtype; in float32 at least
    4 x 2^-20): the decoder is lossless w.r.t. its own verification forwards."""
    from draftsmith.eval.greedy_equality import greedy_equality
    from draftsmith.eval.mtbench import Prompt
    methods = {}
    for name, d in drafters_by_name.items():
        for mode in MODES:
            try:
                methods[f"{name} {mode}"] = decoder(target, d, mode, SamplingParams(0.0))
            except NotApplicable:
                continue
    r = greedy_equality(target, methods, [Prompt(0, "random", "", list(prompt))], n_new, tie_gap=4 * 2.0 ** -20)
    ms = r["methods"]
    return {"equal": sum(m["equal"] for m in ms.values()), "runs": len(ms), "tie_gap": r["tie_gap"],
            "results": {k: "equal" if m["equal"] else m["divergences"] for k, m in ms.items()}, "ok": r["pass"]}


# ------------------------------------------------------------------------------------------------ families
def section_families(ck: Check, dev: torch.device, quick: bool) -> None:
    """Every family's tiny target on the device, float32: plain decoding and each kind (chain, and a tree for the
    head kinds) against the model's own greedy tokens; the kinds a family lacks refused by name; Gemma 3's
    verification without its windows must differ; the batched decoder past the window, plain and drafting."""
    from draftsmith.engine.batched import BatchedSpeculativeDecoder
    from draftsmith.engine.kvcache import sliding_windows
    from tests.families import FAMILIES, family_target
    from tests.test_families import KINDS, NEW, PROMPT, REFUSED, TREE, TREES
    from tests.tiny import greedy_reference

    for family in FAMILIES[-2:] if quick else FAMILIES:
        with ck.case(f"families {family}: plain and every kind, greedy, chains and a tree", family=family,
                     need_s=2) as rec:
            if rec is None:
                continue
            tgt = family_target(family)
            tgt.model.to(dev)
            eos = set(tgt.eos_token_ids)
            ref, _ = greedy_reference(tgt.model, PROMPT, NEW, eos)
            results = {"plain": SpeculativeDecoder(tgt).generate(PROMPT, NEW).tokens == ref}
            for name, (kind, fields) in KINDS.items():
                if (family, name) in REFUSED:
                    try:
                        registry.get(kind).for_target(tgt, **fields)
                        results[name] = False  # built where it must be refused
                    except ValueError as e:
                        results[name] = "refused" if tgt.model.config.model_type in str(e) else False
                    continue
                if name == "kangaroo" and sliding_windows(tgt.model.config):
                    results[name] = "n/a past a window"
                    continue
                torch.manual_seed(1)
                m = registry.get(kind).for_target(tgt, **fields).to(dev).eval()
                d = m.decoder_drafter(tgt, tgt.fingerprint)
                results[name] = SpeculativeDecoder(tgt, d).generate(PROMPT, NEW).tokens == ref
                if name in TREES:
                    results[f"{name} tree"] = SpeculativeDecoder(tgt, d, tree=TREE).generate(PROMPT, NEW).tokens == ref
            rec.update(results={k: v if isinstance(v, str) else ("equal" if v else "DIFFERENT")
                                for k, v in results.items()},
                       equal=sum(v is True for v in results.values()), cases=len(results))
            rec["ok"] = all(v is not False for v in results.values())
    with ck.case("families gemma3: windows off must give other tokens (negative control); batched decoder past "
                 "the window", family="gemma3", need_s=2) as rec:
        if rec is not None:
            tgt = family_target("gemma3")
            tgt.model.to(dev)
            eos = set(tgt.eos_token_ids)
            ref, _ = greedy_reference(tgt.model, PROMPT, NEW, eos)
            torch.manual_seed(1)
            d = registry.get("medusa").for_target(tgt, num_heads=2).to(dev).eval().decoder_drafter(
                tgt, tgt.fingerprint)
            dec = SpeculativeDecoder(tgt, d)
            dec.windows = {}
            rec["windows_off_differs"] = dec.generate(PROMPT, NEW).tokens != ref
            other = PROMPT[:5]
            ref2, _ = greedy_reference(tgt.model, other, NEW, eos)
            plain = BatchedSpeculativeDecoder(tgt, None).generate([PROMPT], [NEW])
            rec["batched_plain_equal"] = plain.rows[0].tokens == ref
            out = BatchedSpeculativeDecoder(tgt, d, k=2).generate([PROMPT, other], [NEW, NEW])
            rec["batched_medusa_equal"] = [r.tokens for r in out.rows] == [ref, ref2]
            rec["ok"] = rec["windows_off_differs"] and rec["batched_plain_equal"] and rec["batched_medusa_equal"]
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ step costs
RECIPES = ("quickstart", "compare-medusa", "compare-hydra-pp", "eagle3", "kangaroo", "standalone",
           "standalone-pruned")


def recipe_drafter(name: str, target: Target, seed: int = 0):
    """The drafter a recipe trains, built for ``target`` with its initial weights (a pruned one keeps random ids):
    its cost is its shape's, whatever the weights."""
    from draftsmith.recipe import load_recipe
    from draftsmith.train.training.trainer import build_drafter
    from draftsmith.common.vocab import draft_head
    r = load_recipe(name)
    m = build_drafter(r, target)
    dh = draft_head(m)
    if dh is not None:
        g = torch.Generator().manual_seed(seed)
        m.set_draft_vocab(torch.randperm(target.vocab_size, generator=g)[: len(dh.kept_ids)].sort().values)
    p = next(target.model.parameters())
    m = m.to(device=p.device, dtype=p.dtype).eval()
    return r, m.decoder_drafter(target, target.fingerprint, name)


@torch.no_grad()
def graph_forward_times(target: Target, rows: list[int], capacity: int, repeats: int) -> dict:
    """Our static-shape forward (body only) captured once per row count as a CUDA graph and replayed: what a
    decoder step would cost without the CPU's kernel launches. Every shape is static as in the compiled path: the
    rows attend over the cache's whole capacity (slots past the live length masked out), so one graph per row
    count serves every context. Returns {rows: median seconds of a replay}."""
    from draftsmith.engine.kvcache import KVCache
    fb = target.fast_body
    core, dev = fb.core, next(target.model.parameters()).device
    cache = KVCache.for_model(target.model, capacity)
    kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    out, graphs = {}, []  # every graph kept until all are timed (each in its own memory pool)
    for n in rows:
        c = capacity - n  # the live context: everything before these rows
        ids = torch.randint(3, target.vocab_size, (n,), device=dev)
        cos, sin = core.rope(torch.arange(c, c + n, device=dev))
        mask = torch.zeros(1, 1, n, capacity, dtype=fb.dtype, device=dev)
        mask[0, 0, :, c:] = torch.finfo(fb.dtype).min
        mask[0, 0, :, c:] = mask[0, 0, :, c:].triu(1)  # causal among the n rows
        slots = torch.arange(c, c + n, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                core(ids, cos, sin, None, slots, kv, "mask", (mask,), logits=False)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            core(ids, cos, sin, None, slots, kv, "mask", (mask,), logits=False)
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[n] = sorted(times)[len(times) // 2]
        graphs.append(g)
    torch.cuda.synchronize(dev)
    return out


def section_costs(ck: Check, dev: torch.device, quick: bool, dtypes: list[str], out: Path, hardware: str,
                  command: str, rounds: int = 3) -> None:
    from draftsmith.sim.calibrate import Calibrator, ForwardTimer
    from draftsmith.sim.profile import DrafterCost, ForwardTable, Overhead, Profile

    rows = [1, 2, 4, 8, 16, 32] if quick else [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    contexts = [0, 64] if quick else [0, 128, 512, 1024, 2048]
    repeats = 2 if quick else 5
    # the calibration decoders' forwards: prefills of these prompts (<= 32 rows) and steps of <= 8 rows
    cal_rows = [r for r in rows if r <= 32]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (int(n),), generator=g).tolist() for n in ([12, 16] if quick else [24, 28, 32])]
    for dname in dtypes:
        try:
            target = shape_target(dev, DTYPES[dname], layers=4 if quick else None)
        except Exception as e:  # noqa: BLE001
            with ck.case(f"costs {dname} build", force=True):
                raise e
            continue
        tables = {}
        for forward in ("eager", "fast"):  # the model's own forward | our static-shape forward, eagerly
            use_fast_forward(target, forward)
            title = f"costs {dname} forward table ({forward})"
            with ck.case(title, dtype=dname, forward=forward) as rec:
                if rec is None:
                    if ck.reused(title):
                        tables[forward] = ForwardTable(**ck.reused(title)["table"])
                    continue
                timer = ForwardTimer(target, rows, contexts)
                for _ in range(repeats):
                    timer.round()
                tables[forward] = timer.table()
                t = tables[forward]
                one = t.seconds[0][0] + t.head_seconds[0]
                rec.update(one_row_ms=1e3 * one, **{
                    f"rows{r}_ctx{c}_x": (t.seconds[ci][ri] + t.head_seconds[ri]) / one
                    for ci, c in enumerate(t.contexts) for ri, r in enumerate(t.rows)
                    if r in (4, 8, 16, 64, 256) and c in (0, contexts[-1])},
                    table={"rows": t.rows, "contexts": t.contexts, "seconds": t.seconds,
                           "head_seconds": t.head_seconds})
        use_fast_forward(target, "fast")
        # each recipe's drafter: chains of several lengths, a tree for the heads, batched chains; fitted
        profile, overhead = None, None
        for name in (RECIPES[:2] if quick else RECIPES) if dname == dtypes[0] else ():
            title = f"costs {dname} drafter {name}"
            with ck.case(title, dtype=dname, drafter=name, need_s=5) as rec:
                if rec is None:
                    p = ck.reused(title)
                    if p and p.get("pass_ms"):
                        if profile is None:
                            profile, overhead = {}, Overhead(**p.get("overhead", {
                                "step_s": p["overhead_step_ms"] / 1e3}))
                        profile[name] = DrafterCost(pass_s=p["pass_ms"] / 1e3, step_s=p["step_ms"] / 1e3,
                                                    node_s=p["node_ms"] / 1e3,
                                                    source="fitted by draftsmith.sim.calibrate (earlier run)")
                    continue
                recipe, dd = recipe_drafter(name, target)
                tree = [(0,), (1,), (0, 0), (2,), (0, 1), (0, 0, 0), (1, 0)] if capabilities(dd).supports_trees \
                    and recipe.drafter.kind in ("hydra", "medusa", "eagle3") else None
                kw = dict(name=f"gpu-{dname}", hardware=hardware, drafter=dd, drafter_name=name, tree=tree,
                          tree_depth=3 if tree else None, ks=(1, 2, 4), max_new_tokens=16 if quick else 32,
                          rows=cal_rows, contexts=contexts[:2])
                try:
                    cal, batched = Calibrator(target, batch_sizes=(2, 4), **kw), True
                except ValueError as e:  # a drafter the batched decoder does not take
                    cal, batched, rec["batched"] = Calibrator(target, batch_sizes=(), **kw), False, f"not measured: {e}"
                for i in range(2 if quick else rounds):
                    cal.round(prompts, i)
                prof, rep = cal.fit()
                d = prof.drafters.get(name)
                rec.update(pass_ms=1e3 * d.pass_s if d else None, step_ms=1e3 * d.step_s if d else None,
                           node_ms=1e3 * d.node_s if d else None, overhead_step_ms=1e3 * prof.overhead.step_s,
                           overhead=prof.overhead.model_dump(),
                           residual_rms_ms=1e3 * rep["residual_rms_s"], runs=rep["runs"], batched_fit=batched)
                if d is not None:
                    if profile is None:
                        profile, overhead = {}, prof.overhead
                    profile[name] = d
        if "fast" in tables:
            prof = Profile(
                name=f"{_gpu_slug(hardware)}-smollm2-shape-{dname}", hardware=hardware, source=command,
                assumptions=[
                    "MEASURED on the machine named in hardware, with a random model of SmolLM2-135M-Instruct's exact "
                    "shape (weights do not change a step's cost); forward times: medians of interleaved rounds, "
                    "our static-shape forward run eagerly (engine/fastpath.py, --forward fast); contexts beyond the "
                    "table are clamped to its largest",
                    "drafters: each recipe's drafter with its initial weights, cost fitted by least squares on "
                    "decoding runs (draftsmith.sim.calibrate); host overheads from the first recipe's fit"],
                target={"name": "smollm2-135m-instruct", "vocab_size": int(target.vocab_size),
                        "shape": "random weights of the default target's shape"},
                forward=tables["fast"], overhead=overhead or Overhead(),
                drafters=profile or {})
            path = prof.save(out / f"gpu_profile_{dname}.yaml")
            ck.data.setdefault("profiles", {})[dname] = str(path)
            print(f"  profile written: {path}", flush=True)
        del target
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _gpu_slug(hardware: str) -> str:
    s = "".join(c if c.isalnum() else "-" for c in hardware.lower())
    return "-".join(w for w in s.split("-") if w)[:40]


def section_graphs(ck: Check, dev: torch.device, quick: bool, dtypes: list[str]) -> None:
    """Last, on its own: our static-shape forward replayed as CUDA graphs beside the same forward run eagerly
    (body only), by rows. The decoder does not capture graphs; this measures what they would save on this machine.
    (Run last: a capture that fails can leave the CUDA generator unusable for the rest of the process.)"""
    if dev.type != "cuda":
        with ck.case("graphs: CUDA graph replay") as rec:
            if rec is not None:
                raise NotApplicable("CUDA graphs need a CUDA device")
        return
    from draftsmith.sim.calibrate import ForwardTimer
    rows, cap = [1, 2, 4, 8, 16, 32], 2048 + 32
    for dname in dtypes:
        with ck.case(f"graphs {dname} forward: CUDA graph replay vs eager, body only", dtype=dname) as rec:
            if rec is None:
                continue
            target = shape_target(dev, DTYPES[dname], layers=4 if quick else None)
            use_fast_forward(target, "fast")
            timer = ForwardTimer(target, rows, [cap - 32])
            for _ in range(5):
                timer.round()
            eager = timer.table()
            gr = graph_forward_times(target, rows, cap, 30)
            rec.update(graph_ms={str(r): 1e3 * v for r, v in gr.items()},
                       eager_ms={str(r): 1e3 * eager.seconds[0][i] for i, r in enumerate(rows)},
                       eager_over_graph={str(r): eager.seconds[0][i] / gr[r] for i, r in enumerate(rows)},
                       one_row_ms=1e3 * gr[1])
            del target, timer


# ------------------------------------------------------------------------------------------------ training
def random_sequences(n: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    """Token rows for a training cache: random ids (the costs do not depend on them), the first eighth a prompt."""
    g = torch.Generator().manual_seed(seed)
    p = max(1, length // 8)
    return [{"ids": torch.randint(3, vocab, (length,), generator=g).tolist(), "mask": [0] * p + [1] * (length - p)}
            for _ in range(n)]


def section_train(ck: Check, dev: torch.device, quick: bool, work: Path) -> None:
    from draftsmith.drafters.eagle3.config import default_aux_layers
    from draftsmith.recipe import load_recipe, parse_recipe
    from draftsmith.train.data.cache import build_cache
    from draftsmith.train.training.trainer import train

    target = shape_target(dev, torch.float32, layers=4 if quick else None)
    L = int(target.config.num_hidden_layers)
    recipes = {}
    for name in RECIPES:
        r = load_recipe(name)
        raw = r.model_dump(mode="json")
        raw["drafter"] = {k: v for k, v in raw["drafter"].items() if v is not None}
        if raw["drafter"]["kind"] == "eagle3" and "aux_layers" not in raw["drafter"]:  # read from the target
            raw["drafter"]["aux_layers"] = default_aux_layers(L)
        recipes[name] = raw
    needs = []
    for raw in recipes.values():
        for nd in registry.get(raw["drafter"]["kind"]).cache_needs(raw["drafter"]):
            if nd not in needs:
                needs.append(nd)
    n, length = (6, 128) if quick else (48, 1024)
    cache_dir = work / "train-cache"
    todo = [nm for nm in recipes if not ck.reused(f"train {nm}")]
    if not todo:
        for nm in recipes:
            with ck.case(f"train {nm}"):
                pass  # recorded from the earlier run (the body does not run)
        return
    with ck.case("train cache of random sequences", rerun=bool(todo), needs=needs, sequences=n, length=length) as rec:
        if rec is None:
            return
        t0 = time.perf_counter()
        build_cache(target, random_sequences(n, length, target.vocab_size), needs, cache_dir, dtype="float16")
        sync(dev)
        rec.update(tokens=n * length, tokens_per_s=n * length / (time.perf_counter() - t0),
                   disk_mb=round(sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file()) / 2**20, 1))
    if rec.get("status") != "pass":
        return
    steps = 3 if quick else 12
    for i, (name, raw) in enumerate(recipes.items()):
        with ck.case(f"train {name}", kind=raw["drafter"]["kind"], need_s=8) as rec:
            if rec is None:
                continue
            raw = json.loads(json.dumps(raw))
            raw.update(name=f"gpucheck-{i}", output_dir=str(work / f"train-{i}"))
            raw.pop("shared_data", None)
            raw["train"].update(max_steps=steps, tracker="none", save_every=10_000, log_every=steps)
            if quick:
                raw["train"].update(batch_size=2, chunk_len=min(raw["train"]["chunk_len"], 64), grad_accum=1)
            recipe = parse_recipe(raw)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            _, timing = train(recipe, target, cache_dir, recipe.out, resume=False)
            sync(dev)
            t = recipe.train
            rec.update(steps=timing["steps"], batch=f"{t.batch_size}x{t.chunk_len}x{t.grad_accum}",
                       positions=timing["positions"], wall_s=timing["wall_s"],
                       positions_per_s=timing["positions"] / timing["wall_s"],
                       math_share=timing["math_s"] / timing["wall_s"], mixed_precision=t.mixed_precision or "no")
            if dev.type == "cuda":
                rec.update(peak_mem_mb=round(torch.cuda.max_memory_allocated(dev) / 2**20),
                           peak_over_target_mb=round((torch.cuda.max_memory_allocated(dev) - base) / 2**20))
            shutil.rmtree(recipe.out, ignore_errors=True)
    del target


def section_launch(ck: Check, dev: torch.device, quick: bool, work: Path) -> None:
    """One ``accelerate launch -m draftsmith.cli train RECIPE`` on a saved random default-shape target (a local
    Hugging Face directory, as users bring) and a cache written for it."""
    from draftsmith.target import load_target
    from draftsmith.train.data.cache import build_cache

    tdir, run = work / "launch-target", work / "launch-run"
    what = "gpu_ddp.yaml, 1 process" if dev.type == "cuda" else "cpu_single.yaml"
    todo = not ck.reused(f"launch: accelerate launch ({what}) -m draftsmith.cli train")
    with ck.case("launch: save the random default-shape target as a local model directory", rerun=todo) as rec:
        if rec is None:
            return
        t = shape_target(torch.device("cpu"), torch.float32, layers=4 if quick else None)
        t.model.save_pretrained(tdir)
        t.tokenizer.save_pretrained(tdir)
        loaded = load_target(tdir, device=dev)
        build_cache(loaded, random_sequences(8, 128, loaded.vocab_size, seed=3), ["final"], run / "cache" / "train",
                    dtype="float16")
        rec.update(target=str(tdir), fingerprint=loaded.fingerprint)
        del t, loaded
    if rec is None or rec.get("status") != "pass":
        for what in ("gpu_ddp.yaml, 1 process",) if dev.type == "cuda" else ("cpu_single.yaml",):
            name = f"launch: accelerate launch ({what}) -m draftsmith.cli train"
            if ck.reused(name):
                with ck.case(name):
                    pass  # recorded from the earlier run (the body does not run)
        return
    recipe = {"name": "launch", "target": str(tdir), "output_dir": str(run),
              "drafter": {"kind": "hydra", "num_heads": 2, "num_layers": 1},
              "train": {"max_steps": 2, "batch_size": 4, "chunk_len": 64, "tracker": "none", "save_every": 2,
                        "log_every": 1, "warmup_steps": 1, "calibration_every": 0}}
    rpath = work / "launch.yaml"
    import yaml
    rpath.write_text(yaml.safe_dump(recipe))
    base = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
            "--dynamo_backend", "no"]
    if dev.type == "cuda":
        variants = {"gpu_ddp.yaml, 1 process": base[:3] + ["--config_file", "recipes/launch/gpu_ddp.yaml",
                                                             "--num_processes", "1"]}
    else:
        variants = {"cpu_single.yaml": base[:3] + ["--config_file", "recipes/launch/cpu_single.yaml"]}
    for what, cmd in variants.items():
        with ck.case(f"launch: accelerate launch ({what}) -m draftsmith.cli train", need_s=20) as rec:
            if rec is None:
                continue
            shutil.rmtree(run / "checkpoints", ignore_errors=True)
            full = cmd + ["-m", "draftsmith.cli", "train", str(rpath), "--fresh"]
            t0 = time.perf_counter()
            p = subprocess.run(full, capture_output=True, text=True, timeout=max(30, ck.time_left()))
            out = p.stdout + p.stderr
            rec.update(rc=p.returncode, wall_s=time.perf_counter() - t0, command=" ".join(full), tail=out[-1500:])
            if p.returncode != 0:  # the trainer's own error, which the launcher's traceback after it hides
                start = out.find("Traceback (most recent call last)")
                rec["first_error"] = out[start:start + 3000] if start >= 0 else out[:3000]
            rec["checkpoint"] = (run / "final" / "model.safetensors").exists()
            rec["ok"] = p.returncode == 0 and rec["checkpoint"]


# ------------------------------------------------------------------------------------------------ main
def environment(dev: torch.device) -> dict:
    import transformers
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if dev.type == "cuda":
        pr = torch.cuda.get_device_properties(dev)
        env.update(gpu=torch.cuda.get_device_name(dev), gpu_memory_gb=round(pr.total_memory / 2**30, 1),
                   sms=pr.multi_processor_count, cuda=torch.version.cuda, bf16=torch.cuda.is_bf16_supported())
        try:
            import accelerate
            env["accelerate"] = accelerate.__version__
        except ImportError:
            env["accelerate"] = None
    return env


def summary(data: dict) -> str:
    cases = data["cases"]
    by: dict = {}
    for c in cases:
        by.setdefault(c["section"], {}).setdefault(c["status"], 0)
        by[c["section"]][c["status"]] += 1
    lines = ["", f"gpu_check on {data['env'].get('gpu') or data['env']['cpu']} ({data['device']}), "
             f"{data['elapsed_s']:.0f} s:"]
    lines += [f"  {s:7s} " + ", ".join(f"{n} {k}" for k, n in sorted(v.items())) for s, v in by.items()]
    bad = [c for c in cases if c["status"] in ("fail", "error")]
    for c in bad[:30]:
        what = c.get("error") or {k: c[k] for k in c
                                  if k.startswith("tv") or k in ("p_value", "results", "first_error", "tail")}
        lines.append(f"  {c['status'].upper()}: {c['name']}: {str(what)[:400]}")
    tr = [c for c in cases if c["section"] == "train" and c.get("positions_per_s")]
    if tr:
        lines.append("  training positions/s (peak MB): " + ", ".join(
            f"{c['name'][6:]} {c['positions_per_s']:.0f} ({c.get('peak_mem_mb', '-')})" for c in tr))
    for c in cases:
        if c["section"] == "costs" and "one_row_ms" in c:
            lines.append(f"  {c['name']}: 1 row {c['one_row_ms']:.2f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes and few cases: the CPU rehearsal")
    ap.add_argument("--budget-s", type=float, default=420.0, help="the whole run's time; sections share it")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--samples", type=int, default=400, help="Monte Carlo samples per method (default shape)")
    ap.add_argument("--dtypes", nargs="+", default=None, choices=["float64", "float32", "bfloat16"],
                    help="only these dtypes (default: float64 and bfloat16 for exact; float32 and bfloat16 otherwise)")
    ap.add_argument("--calibration-rounds", type=int, default=3, help="decoding rounds per drafter cost fit")
    ap.add_argument("--previous", default=None, help="an earlier run's gpu_check.json: the cases it passed (or found "
                    "not applicable) are taken from it, the rest run again")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(a.out)
    ck = Check(out, a.budget_s, str(dev), Path(a.previous) if a.previous else None)
    ck.data["env"] = environment(dev)
    ck.data["command"] = " ".join([Path(sys.executable).name, "-m", "benchmarks.gpu_check", *(argv or sys.argv[1:])])
    ck.data["quick"] = a.quick
    print(json.dumps(ck.data["env"]), flush=True)
    hardware = ck.data["env"].get("gpu") or f"CPU {ck.data['env']['cpu']}"
    bf16 = dev.type == "cpu" or torch.cuda.is_bf16_supported()
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))

    def pick(dtypes: list[str]) -> list[str]:
        return [d for d in dtypes if a.dtypes is None or d in a.dtypes]

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (the default; said once here)
    try:
        todo = list(a.sections)
        for s in list(todo):
            ck.begin(s, todo)
            try:
                if s == "exact":
                    section_exact(ck, dev, a.quick, pick(["float64"] + (["bfloat16"] if bf16 else [])))
                elif s == "shape":
                    section_shape(ck, dev, a.quick, pick(["float32"] + (["bfloat16"] if bf16 else [])), a.samples)
                elif s == "families":
                    section_families(ck, dev, a.quick)
                elif s == "costs":
                    section_costs(ck, dev, a.quick, pick((["bfloat16"] if bf16 else []) + ["float32"]), out, hardware,
                                  ck.data["command"], a.calibration_rounds)
                elif s == "graphs":
                    section_graphs(ck, dev, a.quick, pick((["bfloat16"] if bf16 else []) + ["float32"]))
                elif s == "train":
                    section_train(ck, dev, a.quick, work)
                elif s == "launch":
                    section_launch(ck, dev, a.quick, work)
            except Exception as e:  # noqa: BLE001 -- a section that breaks outside a case is recorded too
                with ck.case(f"{s}: section", force=True, section_error=True):
                    raise e
            ck.end()
            todo.remove(s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        ck.save()
    print(summary(ck.data), flush=True)
    return 0 if not any(c["status"] in ("fail", "error") for c in ck.data["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
