"""Logits processors (penalties, logit bias) inside speculative decoding: exact enumeration of the decoder's
output distribution against the processed target's own (cache-free full forwards, processors applied to the
whole context), for chains, static and dynamic trees and the batched decoder; greedy equality with plain
decoding under processors; recorded logprobs equal the processed target's log-softmax."""

from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.engine.batched import BatchedSpeculativeDecoder
from draftsmith.drafters.standalone.decode import ModelDrafter
from draftsmith.engine.decoder import SpeculativeDecoder, plain_decoder
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.processors import Penalties, RequestProcessing
from draftsmith.engine.sampling import SamplingParams, TorchRandom, processed_probs
from draftsmith.engine.trees import DynamicTree
from draftsmith.eval.exact import enumerate_branches, exact_distribution, total_variation
from tests.test_decoder import other_model_drafter, random_medusa, tiny

PROMPT = [1, 3, 4, 3]
N_NEW = 3
TEMP = SamplingParams(0.8)
# every processor at once; the bias favours a token the prompt does not contain
PEN = Penalties(frequency=0.7, presence=0.4, repetition=1.6, logit_bias=((2, 1.5), (4, -0.8)))


@pytest.fixture(scope="module")
def tgt():
    return tiny(vocab=6, seed=0, std=0.5, layers=2, dtype=torch.float64)


@torch.no_grad()
def processed_target_distribution(target, prompt, n_new, sampling, proc):
    """The processed target's distribution over outputs: full forwards, processors on the whole context."""
    eos = set(target.eos_token_ids)
    out: dict[tuple[int, ...], float] = {}

    def walk(seq, w, left):
        if left == 0 or (len(seq) > len(prompt) and seq[-1] in eos):
            out[tuple(seq[len(prompt):])] = out.get(tuple(seq[len(prompt):]), 0.0) + w
            return
        logits = target.model(torch.tensor([seq])).logits[0, -1]
        x = proc.logits_for(seq, len(prompt), logits)
        p = sampling.probs(x).double()
        p = p / p.sum()
        for t in torch.nonzero(p > 0).flatten().tolist():
            walk(seq + [t], w * float(p[t]), left - 1)

    walk(list(prompt), 1.0, n_new)
    return out


@pytest.fixture(scope="module")
def reference(tgt):
    return processed_target_distribution(tgt, PROMPT, N_NEW, TEMP, RequestProcessing(PEN))


def test_processors_change_the_distribution(tgt, reference):
    """The reference is not the unprocessed one (so the checks below have teeth), and each processor alone
    changes it too."""
    plain = processed_target_distribution(tgt, PROMPT, N_NEW, TEMP, RequestProcessing())
    assert total_variation(plain, reference) > 0.05
    for one in (Penalties(frequency=0.7), Penalties(presence=0.4), Penalties(repetition=1.6),
                Penalties(logit_bias=((2, 1.5),))):
        d = processed_target_distribution(tgt, PROMPT, N_NEW, TEMP, RequestProcessing(one))
        assert total_variation(plain, d) > 0.01, one


def _exact(tgt, drafter, proc, **kw):
    dec = SpeculativeDecoder(tgt, drafter, sampling=TEMP, **kw)
    dec.processing = proc
    return exact_distribution(dec, PROMPT, N_NEW)


@pytest.mark.parametrize("case", ["chain", "chain-raw-draft", "static-tree", "dynamic-tree"])
def test_single_sequence_decoder_with_processors_is_exact(tgt, reference, case):
    if case == "chain":
        got = _exact(tgt, other_model_drafter(tgt), RequestProcessing(PEN), policy=FixedLength(2))
    elif case == "chain-raw-draft":  # the draft left unprocessed: slower, still lossless
        got = _exact(tgt, other_model_drafter(tgt), RequestProcessing(PEN, process_draft=False), policy=FixedLength(2))
    elif case == "static-tree":
        got = _exact(tgt, random_medusa(tgt, num_heads=2, std=0.5), RequestProcessing(PEN),
                     tree=[(0,), (1,), (0, 0)])
    else:
        got = _exact(tgt, random_medusa(tgt, num_heads=2, std=0.5), RequestProcessing(PEN),
                     tree=DynamicTree(budget=3, max_depth=2, width=2, expand_batch=1))
    assert abs(sum(got.values()) - 1.0) < 1e-12
    assert total_variation(got, reference) < 1e-9


def test_processing_only_the_root_context_is_lossy_and_detected(tgt, reference):
    """Teeth: a processor that ignores the drafted prefix (every node sees only the committed tokens) is not
    the target's processed distribution."""

    class RootOnly(RequestProcessing):
        def node_logits(self, tokens, prompt_len, tree, start, end, logits):
            ctx = list(tokens)
            return torch.stack([self.logits_for(ctx, prompt_len, row) for row in logits])

    got = _exact(tgt, other_model_drafter(tgt), RootOnly(PEN), policy=FixedLength(2))
    assert total_variation(got, reference) > 1e-3


@pytest.mark.parametrize("tree", [None, [(0,), (1,)]], ids=["chain", "static-tree"])
def test_batched_row_with_processors_is_exact(tgt, reference, tree):
    """One row enumerated exactly while another row (other prompt, other processors) decodes beside it.
    The tree is two siblings (depth-2 trees under processors: the single-sequence test above; the batched
    decoder's deeper trees: tests/test_batched.py): every replay re-runs both rows, and a third node
    multiplies the branches (87 s on an AVX-512 Xeon, twice that on an AVX2 EPYC)."""
    drafter = other_model_drafter(tgt) if tree is None else random_medusa(tgt, num_heads=2, std=0.5)
    dec = BatchedSpeculativeDecoder(tgt, drafter, tree=tree, k=2, sampling=TEMP)
    prompts, news = [[1, 3, 4, 3, 5, 4], PROMPT], [2, N_NEW]

    def run(src):
        res = dec.generate(prompts, news, rngs=[TorchRandom(7), src],
                           processing=[RequestProcessing(Penalties(presence=1.0)), RequestProcessing(PEN)])
        return tuple(res.rows[1].tokens)

    got: dict = {}
    for out, w, _ in enumerate_branches(run):
        got[out] = got.get(out, 0.0) + w
    assert abs(sum(got.values()) - 1.0) < 1e-12
    assert total_variation(got, reference) < 1e-9


def test_greedy_with_processors_equals_plain_and_logprobs_are_the_processed_targets():
    t = tiny(vocab=40, seed=1, std=0.5, layers=2)
    prompt = [1, 5, 7, 5, 9, 11]
    eos_ban = tuple((e, -100.0) for e in t.eos_token_ids)  # the full 20 tokens
    pen = Penalties(frequency=0.5, presence=0.3, repetition=1.3, logit_bias=((7, 2.0), (3, -5.0), *eos_ban))
    ref_dec = plain_decoder(t)
    ref_dec.processing = RequestProcessing(pen, t.vocab_size, top_logprobs=3)
    ref = ref_dec.generate(prompt, 20).tokens
    no_proc = plain_decoder(t).generate(prompt, 20).tokens
    assert ref != no_proc  # the processors changed the greedy output
    # the plain decoder's own logprobs equal the processed target's full-forward log-softmax
    lps = ref_dec.processing.logprobs
    assert [x.token for x in lps] == ref
    with torch.no_grad():
        for j, x in enumerate(lps):
            seq = prompt + ref[:j]
            logits = t.model(torch.tensor([seq])).logits[0, -1]
            want = torch.log_softmax(RequestProcessing(pen).logits_for(seq, len(prompt), logits).double(), -1)
            assert abs(x.logprob - float(want[x.token])) < 1e-4
            assert [i for i, _ in x.top] == torch.topk(want, 3).indices.tolist()
    # the target's own copy as the drafter: with the draft processed along its path like the target, every
    # drafted token is accepted (a draft processed with the wrong context would be rejected)
    selfdraft = ModelDrafter(copy.deepcopy(t.model), t.fingerprint, name="self")
    for drafter, tree in [(selfdraft, None), (selfdraft, [(0,), (1,), (0, 0)]),
                          (random_medusa(t, num_heads=2), [(0,), (1,), (0, 0)])]:
        dec = SpeculativeDecoder(t, drafter, tree=tree)
        dec.processing = RequestProcessing(pen, t.vocab_size, top_logprobs=3)
        res = dec.generate(prompt, 20)
        assert res.tokens == ref
        assert [x.token for x in dec.processing.logprobs[:len(ref)]] == ref
        assert max(abs(a.logprob - b.logprob) for a, b in zip(dec.processing.logprobs, lps)) < 1e-4
        if drafter is selfdraft:
            assert sum(s.accepted for s in res.steps) == sum(s.attempted for s in res.steps) > 10
        bdec = BatchedSpeculativeDecoder(t, drafter, tree=tree, k=2)
        procs = [RequestProcessing(pen, top_logprobs=0), None, RequestProcessing(pen)]
        out = bdec.generate([prompt, prompt, prompt[:4]], [20, 20, 9], processing=procs)
        assert out.rows[0].tokens == ref and out.rows[1].tokens == no_proc
        single = plain_decoder(t)
        single.processing = RequestProcessing(pen)
        assert out.rows[2].tokens == single.generate(prompt[:4], 9).tokens


def test_bad_processor_settings_are_errors():
    with pytest.raises(ValueError, match="repetition"):
        Penalties(repetition=0.0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        RequestProcessing(Penalties(logit_bias=((99, 1.0),)), vocab_size=40)


def test_on_step_can_stop_a_row():
    t = tiny(vocab=40, seed=1, std=0.5, layers=2)
    dec = BatchedSpeculativeDecoder(t, other_model_drafter(t), k=2)
    prompts = [[1, 5, 7, 5], [1, 2, 3]]
    full = dec.generate(prompts, [16, 16])
    seen: dict[int, list[int]] = {0: [], 1: []}

    def hook(row, ids, st, stop):
        seen[row].extend(ids)
        return row == 0 and len(seen[0]) >= 5

    res = dec.generate(prompts, [16, 16], on_step=hook)
    assert res.rows[0].stop_reason == "stop" and 5 <= len(res.rows[0].tokens) < 16
    assert res.rows[0].tokens == full.rows[0].tokens[:len(res.rows[0].tokens)]
    assert res.rows[1].tokens == full.rows[1].tokens


def test_min_p_keeps_tokens_above_a_share_of_the_top_one():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.08]))
    p = processed_probs(logits, 1.0, min_p=0.2)  # keeps p >= 0.1
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.12, 0.0]) / 0.92)
    assert torch.equal(processed_probs(logits, 1.0, min_p=0.0), torch.softmax(logits, -1))
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(1.0, min_p=1.5)


def test_min_p_with_processors_is_exact(tgt):
    """min-p (sampling) and the processors together, chain drafter: exact enumeration."""
    s = SamplingParams(0.8, min_p=0.15)
    ref = processed_target_distribution(tgt, PROMPT, N_NEW, s, RequestProcessing(PEN))
    full = processed_target_distribution(tgt, PROMPT, N_NEW, TEMP, RequestProcessing(PEN))
    assert len(ref) < len(full)  # min-p bites
    dec = SpeculativeDecoder(tgt, other_model_drafter(tgt), sampling=s, policy=FixedLength(2))
    dec.processing = RequestProcessing(PEN)
    got = exact_distribution(dec, PROMPT, N_NEW)
    assert total_variation(got, ref) < 1e-9
