"""Replay logged traffic offline through a suffix cache: acceptance per step of ours vs ArcticInference's.

Each request of the traffic file (``benchmarks.suffix_bench``'s OUT/traffic.json: prompt and response ids,
in serving order) is replayed as the decoder would serve it: at each step the cache drafts after the
prompt and the response so far (at most min(24, room) tokens, room = tokens left - 1), the draft tree is
verified greedily against the logged response (the longest path of the tree that the response follows),
and the accepted tokens plus one are emitted. Each implementation keeps its own state its own way:

  * ``--impl ours``: `draftsmith.drafters.suffix` (per-request index over the prompt and the response so
    far; the finished response joins the global index);
  * ``--impl arctic``: the ``arctic-inference`` package's ``SuffixDecodingCache`` (per-request tree over the
    prompt; the response joins the global tree as it grows: ``add_active_response``).

Same settings for both: depth 24, max_spec_factor 1, offset 0, min_token_prob 0.1, tree speculation.
``arctic`` runs without draftsmith (its own environment, the package importable):

    PYTHONPATH=ARCTIC_DIR python benchmarks/suffix_replay.py --impl arctic --traffic T.json --label greedy \\
        --out arctic.json
    python -m benchmarks.suffix_replay --impl ours --traffic T.json --label greedy --out ours.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEPTH, FACTOR, OFFSET, MIN_PROB = 24, 1.0, 0.0, 0.1


def accepted_along(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Greedy verification of a draft tree against the logged continuation ``truth``."""
    node, n = -1, 0
    while n < len(truth):
        nxt = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == truth[n]), None)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


class Ours:
    def __init__(self):
        # not imported at the top: the arctic replay runs in an environment without draftsmith
        from draftsmith.drafters.suffix import SuffixConfig, SuffixIndex, TokenIndex
        self.cfg = SuffixConfig(max_depth=DEPTH, max_spec_tokens=DEPTH, max_spec_factor=FACTOR,
                                max_spec_offset=OFFSET, min_token_prob=MIN_PROB, tree=True)
        self.glob = SuffixIndex(self.cfg)
        self.TokenIndex = TokenIndex

    def start(self, rid, prompt):
        self.local = self.TokenIndex(self.cfg)
        self.local.extend(prompt)

    def speculate(self, rid, ctx, cap):
        a = self.local.speculate(ctx, cap)
        b = self.glob.speculate(ctx, cap)
        d = b if b.score > a.score else a
        return d.tokens, d.parents

    def emitted(self, rid, toks):
        self.local.extend(toks)

    def stop(self, rid, response):
        self.glob.add_response(response)


class Arctic:
    def __init__(self):
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # its own environment
        self.cache = SuffixDecodingCache(max_tree_depth=DEPTH, max_cached_requests=100000)

    def start(self, rid, prompt):
        self.cache.start_request(rid, prompt)

    def speculate(self, rid, ctx, cap):
        # max_spec_tokens given explicitly: arctic-inference 0.3.0's default (None) reads a missing attribute
        d = self.cache.speculate(rid, ctx, max_spec_tokens=cap, max_spec_factor=FACTOR, max_spec_offset=OFFSET,
                                 min_token_prob=MIN_PROB, use_tree_spec=True)
        return list(d.token_ids), list(d.parents)

    def emitted(self, rid, toks):
        self.cache.add_active_response(rid, toks)

    def stop(self, rid, response):
        self.cache.stop_request(rid)


def replay(impl, traffic: list[dict]) -> dict:
    steps = accepted = drafted = 0
    spec_s = 0.0
    per_request = []
    for k, rec in enumerate(traffic):
        rid, prompt, resp = f"r{k}", list(rec["prompt_ids"]), list(rec["response_ids"])
        impl.start(rid, prompt)
        i, r_steps, r_acc = 0, 0, 0
        while i < len(resp):
            room = len(resp) - i - 1
            acc = 0
            if room > 0:
                t0 = time.perf_counter()
                toks, parents = impl.speculate(rid, prompt + resp[:i], min(DEPTH, room))
                spec_s += time.perf_counter() - t0
                drafted += len(toks)
                acc = min(accepted_along(toks, parents, resp[i:]), room)
            n = acc + 1
            impl.emitted(rid, resp[i:i + n])
            i += n
            r_steps, r_acc = r_steps + 1, r_acc + acc
        impl.stop(rid, resp)
        steps, accepted = steps + r_steps, accepted + r_acc
        per_request.append({"steps": r_steps, "accepted": r_acc, "tokens": len(resp)})
    return {"requests": len(traffic), "steps": steps, "accepted": accepted, "drafted": drafted,
            "accepted_per_step": accepted / steps if steps else 0.0,
            "tokens_per_step": (accepted + steps) / steps if steps else 0.0,
            "speculate_us_per_step": 1e6 * spec_s / steps if steps else None, "per_request": per_request}


def chat_traffic(path: str, target: str, out: str) -> None:
    """A traffic file (label "greedy") from a chat JSONL of {"messages": [user, assistant, ...]} rows: the
    first user turn with the chat template as the prompt, the first assistant turn as the response."""
    # draftsmith only here: the arctic replay runs without it
    from draftsmith.target import load_target
    from draftsmith.traffic import chat_prompt_ids
    tok = load_target(target).tokenizer
    rows = []
    for line in Path(path).read_text().splitlines():
        msgs = json.loads(line).get("messages") or []
        if len(msgs) >= 2 and msgs[0]["role"] == "user" and msgs[1]["role"] == "assistant":
            rows.append({"prompt_ids": chat_prompt_ids(tok, msgs[:1]),
                         "response_ids": tok.encode(msgs[1]["content"], add_special_tokens=False)})
    Path(out).write_text(json.dumps({"greedy": rows}))
    print(f"wrote {out}: {len(rows)} requests, {sum(len(r['response_ids']) for r in rows)} response tokens")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-chat", nargs=3, metavar=("JSONL", "TARGET", "OUT"),
                    help="only write a traffic file from a chat JSONL (see chat_traffic) and stop")
    ap.add_argument("--impl", choices=["ours", "arctic"])
    ap.add_argument("--traffic", help="benchmarks.suffix_bench's traffic.json")
    ap.add_argument("--label", default="greedy", help="which run of the traffic file (greedy, T=0.8)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.from_chat:
        chat_traffic(*a.from_chat)
        return {}
    if not a.impl:
        ap.error("--impl is required")
    traffic = json.loads(Path(a.traffic).read_text())[a.label]
    impl = Ours() if a.impl == "ours" else Arctic()
    out = {"impl": a.impl, "traffic": a.traffic, "label": a.label,
           "settings": {"depth": DEPTH, "max_spec_factor": FACTOR, "max_spec_offset": OFFSET,
                        "min_token_prob": MIN_PROB, "tree": True}, **replay(impl, traffic)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out))
    print(f"{a.impl}: {out['requests']} requests, {out['steps']} steps, accepted/step {out['accepted_per_step']:.4f}, "
          f"tokens/step {out['tokens_per_step']:.4f}, speculate {out['speculate_us_per_step']:.1f} us/step")
    return out


if __name__ == "__main__":
    main()
