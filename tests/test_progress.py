"""Progress bars move with the work: Magpie prompts and self-distilled conversations are counted as rows
finish (not when a whole round ends), and the bar shows the tokens generated while no row has finished."""

import io

import pytest
from tqdm.std import tqdm as std_tqdm

from draftsmith.train.data import generate
from draftsmith.train.data.batchgen import BatchGenerator, Job
from draftsmith.train.data.sources import Conversation
from tests.tiny import make_tiny_target


@pytest.fixture(scope="module")
def peaky():
    return make_tiny_target(init_std=0.5, seed=3)


@pytest.fixture()
def events(monkeypatch):
    """One list of what happened, in order: ("decode",) per decode step, ("update", n) and ("postfix", text)
    per bar call. The bar redraws on every call (mininterval 0) and writes to a buffer."""
    class Log(list):
        bars: list[std_tqdm]

    log = Log()
    bars: list[std_tqdm] = []

    class RecordingBar(std_tqdm):
        def __init__(self, *a, **kw):
            kw.update(file=io.StringIO(), mininterval=0)
            super().__init__(*a, **kw)
            bars.append(self)

        def update(self, n=1):
            log.append(("update", n))
            return super().update(n)

        def set_postfix_str(self, s="", refresh=True):
            log.append(("postfix", s))
            return super().set_postfix_str(s, refresh)

    decode = BatchGenerator._decode

    def counted(self, *a, **kw):
        log.append(("decode",))
        return decode(self, *a, **kw)

    monkeypatch.setattr(generate, "tqdm", RecordingBar)
    monkeypatch.setattr(BatchGenerator, "_decode", counted)
    log.bars = bars
    return log


def _where(log, kind):
    return [i for i, e in enumerate(log) if e[0] == kind]


def test_magpie_bar_moves_as_prompts_are_written(peaky, events):
    out, stats = generate.synthesize_prompts(peaky, 6, max_new_tokens=32, seed=5, min_chars=1, max_rows=2,
                                             round_size=64, on_round=lambda new, draws: events.append(("round",)))
    (bar,) = events.bars
    assert bar.n == len(out) == 6
    updates, decodes, ticks = _where(events, "update"), _where(events, "decode"), _where(events, "postfix")
    assert len(updates) == 6
    # the first round's prompts are counted while its rows still decode (they were all counted at its end)
    end = _where(events, "round")[0]
    last_step = max(d for d in decodes if d < end)
    first_round = [u for u in updates if u < end]
    assert first_round and first_round[0] < last_step
    assert any(first_round[i] < d < first_round[i + 1] for i in range(len(first_round) - 1) for d in decodes)
    # before the first prompt is in, the bar already shows the tokens being written
    assert ticks and ticks[0] < updates[0]
    assert any(e[1].endswith("rejected") and " tok, " in e[1] for e in events if e[0] == "postfix")


def test_magpie_prompts_are_the_same_taken_as_they_come(peaky):
    """Taking results as rows finish (in draw order) keeps the prompts: rows and round sizes do not matter."""
    a, sa = generate.synthesize_prompts(peaky, 7, max_new_tokens=16, seed=9, min_chars=1, max_rows=1, round_size=3)
    b, sb = generate.synthesize_prompts(peaky, 7, max_new_tokens=16, seed=9, min_chars=1, max_rows=5, round_size=64)
    assert [c.user_turns for c in a] == [c.user_turns for c in b]
    assert [c.id for c in a] == [c.id for c in b]


def test_self_distill_bar_moves_per_conversation(peaky, events, tmp_path):
    convs = [Conversation(id=f"c{i}", source="t", user_turns=[f"say something {i}"]) for i in range(6)]
    generate.regenerate(peaky, convs, tmp_path / "out.jsonl", max_new_tokens=12, max_turns=1, batch_size=2,
                        max_seq_len=128, engine="batched", max_rows=2)
    (bar,) = events.bars
    assert bar.n == 6
    updates, decodes, ticks = _where(events, "update"), _where(events, "decode"), _where(events, "postfix")
    assert len(updates) == 6 and updates[0] < decodes[-1]
    assert ticks and ticks[0] < updates[0] and all(e[1].endswith(" tok") for e in events if e[0] == "postfix")


def test_on_step_is_called_after_every_forward(peaky):
    gen = BatchGenerator(peaky.model, peaky.eos_token_ids, max_rows=2, capacity=64, prefill_tokens=8)
    seen: list[tuple[int, int]] = []
    jobs = [Job(i, [1, 5 + i, 9], 6, 0) for i in range(5)]
    gen.run(jobs, lambda j, ids, fin: None,
            on_step=lambda: seen.append((gen.stats["forwards"] + gen.stats["prefill_forwards"],
                                         gen.stats["generated_tokens"])))
    forwards = gen.stats["forwards"] + gen.stats["prefill_forwards"]
    assert [f for f, _ in seen] == list(range(1, forwards + 1))
    assert seen[-1][1] == gen.stats["generated_tokens"]
    assert [t for _, t in seen] == sorted(t for _, t in seen)
