"""L11 §4: stop strings matched on decoded text, across token boundaries, with the real tokenizer.
The expected answer is computed independently: decode everything, cut at the first stop string."""

from __future__ import annotations

import random

import pytest

from harness.smoke import load_tokenizer
import probes_l11
from l11_serve import StopMatcher

pytestmark = pytest.mark.l11

# Characters of two and three UTF-8 bytes among the words, so that windows start and stop inside them.
PASSAGE = ("And God said, “Let there be light”: and there was light. And God saw the light, that it was "
           "good — naïvely good: and God divided the light from the darkness. And God called the light Day, "
           "and the darkness he called Night. And the evening and the morning were the first day.")


@pytest.fixture(scope="module")
def tok(embedded_model_dir):
    """The tests' own tokenizer: what they expect is computed with it."""
    return load_tokenizer(embedded_model_dir)


@pytest.fixture(scope="module")
def matcher_tok(embedded_model_dir):
    """The one StopMatcher reads (judged, in the worker beside it: probes_l11)."""
    return probes_l11.load_tokenizer(embedded_model_dir)


def feed_in_chunks(matcher: StopMatcher, ids: list[int], rng: random.Random) -> list[str]:
    """Feed `ids` in random chunk sizes (an engine step gives 1 token, a speculative one several)."""
    pieces, i = [], 0
    while i < len(ids) and not matcher.stopped:
        k = rng.randint(1, 3)
        pieces.append(matcher.feed(ids[i:i + k]))
        i += k
    return pieces


def expected(tok, ids: list[int], stops: list[str]) -> tuple[str, int | None]:
    """(text up to the earliest stop string, tokens needed to see it) or (all text, None)."""
    full = tok.decode(ids, skip_special_tokens=True)
    hits = [full.find(s) for s in stops if s in full]
    if not hits:
        return full, None
    need = next(k for k in range(1, len(ids) + 1)
                if any(s in tok.decode(ids[:k], skip_special_tokens=True) for s in stops))
    return full[:min(hits)], need


def boundary_stops(tok, ids: list[int], rng: random.Random) -> list[str]:
    """Stop strings that start inside one token and end inside a later one."""
    pieces = [tok.decode([i]) for i in ids]
    starts = [sum(map(len, pieces[:k])) for k in range(len(pieces) + 1)]
    full = "".join(pieces)
    out = []
    while len(out) < 2:
        k = rng.randrange(2, len(ids) - 3)
        if len(pieces[k]) < 2:
            continue
        a = starts[k] + 1  # one character into token k
        out.append(full[a:starts[k + 2] + 1])  # to one character into token k + 2
    return out


@pytest.mark.points(2)
def test_stop_strings_across_token_boundaries_cut_the_text_and_count_the_tokens(tok, matcher_tok):
    ids = tok.encode(PASSAGE, add_special_tokens=False)
    rng = random.Random(0)
    for trial in range(40):
        start = rng.randrange(0, len(ids) // 2)
        window = ids[start:start + rng.randint(12, 30)]
        stops = boundary_stops(tok, window, rng) if trial % 4 else ["light", "Night"]
        matcher = StopMatcher(matcher_tok, stops)
        pieces = feed_in_chunks(matcher, window, rng)
        text, need = expected(tok, window, stops)
        if need is None:
            pieces.append(matcher.flush())
        assert "".join(pieces) == text, (stops, pieces)
        assert matcher.stopped == (need is not None)
        assert matcher.num_tokens == (need if need is not None else len(window))
        assert matcher.feed(window[:2]) == "" if matcher.stopped else True  # after a stop: nothing more


@pytest.mark.points(1)
def test_text_that_may_begin_a_stop_string_is_held_back_until_decided(tok, matcher_tok):
    ids = tok.encode("And God said, Let there be light", add_special_tokens=False)
    matcher = StopMatcher(matcher_tok, ["Let there be darkness"])
    sent, held = "", 0
    for k, token in enumerate(ids):
        sent += matcher.feed([token])
        so_far = tok.decode(ids[:k + 1])
        assert so_far.startswith(sent)
        if so_far.endswith(("Let", " there", " be")):  # could still become the stop string: not sent yet
            assert sent == "And God said, "
            held += 1
    assert held >= 2 and not matcher.stopped
    assert sent == tok.decode(ids)  # "light" decided it: not a stop string, all sent
    assert matcher.flush() == ""


@pytest.mark.points(1)
def test_half_a_character_is_never_sent(tok, matcher_tok):
    text = "naïve — “quoted” café"
    ids = tok.encode(text, add_special_tokens=False)
    matcher = StopMatcher(matcher_tok, ["”"])
    pieces = [matcher.feed([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "naïve — “quoted" and matcher.stopped


# ---------------------------------------------------------------- incremental detokenization (issue 53)


def random_ids(tok, rng: random.Random, n: int) -> list[int]:
    """n ids, half of them pieces of multi-byte characters (their own text is U+FFFD), so that
    characters are split between tokens, left incomplete at the end, or never completed."""
    pieces = [i for i in range(len(tok)) if REPLACEMENT in tok.decode([i])]
    return [rng.choice(pieces) if rng.random() < 0.5 else rng.randrange(len(tok)) for _ in range(n)]


REPLACEMENT = "\ufffd"


def test_the_streamed_text_is_the_whole_decode_for_random_ids(tok, matcher_tok):
    """Whatever the ids (random, split multi-byte characters, special ids), the pieces `feed`
    returns and `flush` then equal decoding every id at once."""
    rng = random.Random(53)
    for trial in range(120):
        ids = random_ids(tok, rng, rng.randint(1, 50))
        matcher = StopMatcher(matcher_tok, [])
        pieces = feed_in_chunks(matcher, ids, rng) + [matcher.flush()]
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True), ids
        assert all(REPLACEMENT not in p for p in pieces[:-1]) or REPLACEMENT in tok.decode(ids[:-1]), ids


def test_each_token_costs_a_bounded_decode_however_long_the_output(tok, embedded_model_dir):
    """1,500 tokens fed one by one: every decode call gets at most a few ids (a window of context
    plus the unread ones), not the whole output, so the 1,500th token costs what the 10th did."""
    counting = probes_l11.counting_tokenizer(embedded_model_dir)
    ids = (tok.encode(PASSAGE, add_special_tokens=False) * 40)[:1500]
    matcher = StopMatcher(counting, ["Amen."])  # never found: every token is searched and sent
    text = "".join(matcher.feed([t]) for t in ids) + matcher.flush()
    assert text == tok.decode(ids)
    decoded = list(counting.decoded)
    assert len(decoded) <= 2 * len(ids) + 2 and max(decoded) <= 12, (len(decoded), max(decoded))
