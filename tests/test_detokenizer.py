"""IncrementalDetokenizer: streamed text equals a full decode, stop strings, holdback, cost."""

from __future__ import annotations

import random

import pytest

from pagedjax.detokenizer import IncrementalDetokenizer

SENTENCES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 👋🏽 🦊🔥 👨‍👩‍👧‍👦 🇫🇷 done.",
    "CJK: 你好，世界！日本語のテキスト。한국어 텍스트.",
    "Accents: café, naïve, Ångström, señor, Zoë, façade, ℕ ≠ ∅ → ∞.",
    'Code:\ndef f(x: int) -> int:\n    """Doc."""\n    return x ** 2  # 平方 ✓\n\tpass\n',
    "Mixed 🙂 emoji🙂 glued, spaces   and\n\nnewlines, a\u200bzero width.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tiny_tok():
    """A byte-level BPE built in-process: few merges, so most non-ASCII characters span several
    tokens; three special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([SENTENCES[0], SENTENCES[4]], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        clean_up_tokenization_spaces=False,
        unk_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )


@pytest.fixture(scope="module")
def smol_tok():
    from models.errors import ModelLoadError
    from models.gguf_loader import default_model_path, gguf_tokenizer

    try:
        return gguf_tokenizer(default_model_path())
    except ModelLoadError as e:
        pytest.skip(str(e))


class CountingTokenizer:
    """Wraps a tokenizer, recording the length of every decode call."""

    def __init__(self, tok):
        self.tok = tok
        self.decode_lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.decode_lengths.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def stream(tok, prompt, ids, *, chunks=None, **kwargs):
    """Feeds ids (one at a time, or in the given chunk sizes) and finalizes unless a stop string
    matched. Returns (detokenizer, deltas, stop string); checks no delta goes past the stop."""
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    deltas, matched, i = [], None, 0
    sizes = chunks or [1] * len(ids)
    for size in sizes:
        if i >= len(ids):
            break
        matched = detok.update(ids[i : i + size])
        i += size
        deltas.append(detok.get_delta())
        assert "".join(deltas) == detok.output_text
        if matched is not None:
            assert detok.finished and detok.stop_reason == matched
            break
    if matched is None:
        detok.finalize()
        deltas.append(detok.get_delta())
    assert "".join(deltas) == detok.output_text
    return detok, deltas, matched


def random_ids(rng, tok, n):
    """Random ids, biased to byte tokens (split characters) and special tokens."""
    vocab = len(tok)
    pools = [range(vocab), range(3, 259), range(3)]
    return [rng.choice(rng.choices(pools, weights=[6, 3, 1])[0]) for _ in range(n)]


def random_chunks(rng, n):
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.choice([1, 1, 1, 2, 3, 7]))
    return sizes


# --- incremental text == full decode -------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_full_decode_tiny(tiny_tok, skip):
    rng = random.Random(0)
    for _ in range(300):
        ids = random_ids(rng, tiny_tok, rng.randint(0, 40))
        prompt = random_ids(rng, tiny_tok, rng.randint(0, 8))
        chunks = random_chunks(rng, len(ids)) if rng.random() < 0.5 else None
        detok, _, _ = stream(tiny_tok, prompt, ids, chunks=chunks, skip_special_tokens=skip)
        assert detok.output_text == tiny_tok.decode(ids, skip_special_tokens=skip), (prompt, ids)
        assert detok.output_token_ids == ids


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_full_decode_smollm2(smol_tok, skip):
    rng = random.Random(1)
    for _ in range(150):
        ids = random_ids(rng, smol_tok, rng.randint(1, 50))
        prompt = random_ids(rng, smol_tok, rng.randint(0, 8))
        detok, _, _ = stream(smol_tok, prompt, ids, skip_special_tokens=skip)
        assert detok.output_text == smol_tok.decode(ids, skip_special_tokens=skip), (prompt, ids)


@pytest.mark.parametrize("tok_name", ["tiny_tok", "smol_tok"])
@pytest.mark.parametrize("sentence", SENTENCES)
def test_real_sentences_match_full_decode(request, tok_name, sentence):
    tok = request.getfixturevalue(tok_name)
    prompt = tok.encode("<|im_start|>user\nSay it<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(sentence + "<|im_end|>")
    assert len(ids) > len(sentence.encode()) // 8  # multi-token characters are exercised
    for skip in (True, False):
        detok, deltas, _ = stream(tok, prompt, ids, skip_special_tokens=skip)
        assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == sentence + "<|im_end|>"
    # A delta never ends inside a multi-token character.
    assert all("\ufffd" not in d for d in deltas)


def test_skip_special_tokens_both_ways(tiny_tok):
    ids = tiny_tok.encode("<|im_start|>Hi 世<|im_end|>界<|endoftext|>")
    kept, _, _ = stream(tiny_tok, [], ids, skip_special_tokens=False)
    dropped, _, _ = stream(tiny_tok, [], ids, skip_special_tokens=True)
    assert kept.output_text == "<|im_start|>Hi 世<|im_end|>界<|endoftext|>"
    assert dropped.output_text == "Hi 世界"


def test_partial_character_held_until_complete_or_finalized(tiny_tok):
    ids = tiny_tok.encode(" 👋")  # "Ġ" then four byte tokens
    assert len(ids) == 5
    detok = IncrementalDetokenizer(tiny_tok, [])
    detok.update(ids[:1])
    assert detok.output_text == " " and detok.get_delta() == " "
    for i in (1, 2, 3):
        detok.update([ids[i]])
        assert detok.get_delta() == ""  # still incomplete
    detok.update(ids[4:])
    assert detok.get_delta() == "👋"
    # Finishing (length) inside a character flushes what a full decode shows.
    detok.update(ids[1:3])
    assert detok.get_delta() == ""
    detok.finalize()
    assert detok.get_delta() == "\ufffd"
    assert detok.output_text == tiny_tok.decode(ids + ids[1:3])


def test_prompt_ending_inside_a_character(tiny_tok):
    ids = tiny_tok.encode("界 ok")
    prompt = tiny_tok.encode("hi ") + ids[:2]  # the prompt cuts 界 after two of its bytes
    detok, _, _ = stream(tiny_tok, prompt, ids[2:])
    assert detok.output_text == tiny_tok.decode(ids[2:])


# --- stop strings ----------------------------------------------------------------------------


def test_stop_string_split_across_tokens_excluded(tiny_tok):
    ids = tiny_tok.encode("The answer is 42.\nQuestion: more text here")
    stop = "\nQuestion:"
    detok, deltas, matched = stream(tiny_tok, [], ids, stop=[stop])
    assert matched == stop and detok.stop_reason == stop and detok.finished
    assert detok.output_text == "The answer is 42."
    assert "".join(deltas) == "The answer is 42."
    # The tokens of the stop string: it was found at the token that completed it.
    assert tiny_tok.decode(detok.output_token_ids).endswith(stop)
    assert len(tiny_tok.decode(detok.output_token_ids[-1:])) < len(stop)
    detok.finalize()  # no-op after a stop
    assert detok.get_delta() == "" and detok.output_text == "The answer is 42."
    with pytest.raises(RuntimeError):
        detok.update([5])


def test_stop_strings_wait_for_min_tokens(tiny_tok):
    """Before min_tokens no stop string ends the output (its text is released as usual, and
    the next token still decodes); from then on one may match, even one begun earlier."""
    ids = [tiny_tok.encode(piece)[0] for piece in ("a", "b", "a", "b", "c")]
    detok = IncrementalDetokenizer(tiny_tok, [], stop=["ab"], min_tokens=3)
    assert detok.update(ids[:1]) is None and detok.update(ids[1:2]) is None
    assert detok.output_text == "ab" and not detok.finished  # 2 tokens < min_tokens
    assert detok.update(ids[2:3]) is None  # "a" held: it may begin "ab"
    assert detok.update(ids[3:4]) == "ab" and detok.output_text == "ab"
    assert detok.finished


def test_stop_string_included(tiny_tok):
    ids = tiny_tok.encode("abc STOP def")
    detok, deltas, matched = stream(
        tiny_tok, [], ids, stop=["STOP"], include_stop_str_in_output=True
    )
    assert matched == "STOP" and detok.output_text == "abc STOP"
    assert "".join(deltas) == "abc STOP"


def test_stop_string_inside_multi_token_characters(tiny_tok):
    ids = tiny_tok.encode("x 世界和平 y")
    detok, _, matched = stream(tiny_tok, [], ids, stop=["界和"])
    assert matched == "界和" and detok.output_text == "x 世"


def test_holdback_is_exact_and_released_on_finalize(tiny_tok):
    detok = IncrementalDetokenizer(tiny_tok, [], stop=["STOP", "<end>"])
    assert detok.update(tiny_tok.encode("abc ST")) is None
    assert detok.output_text == "abc " and detok.get_delta() == "abc "  # "ST" held
    assert detok.update(tiny_tok.encode("x <")) is None
    assert detok.get_delta() == "STx "  # no longer a stop prefix: released; "<" held
    assert detok.update(tiny_tok.encode("en")) is None
    assert detok.output_text == "abc STx "
    detok.finalize()  # e.g. max_tokens reached: the held "<en" is released
    assert detok.get_delta() == "<en"
    assert detok.output_text == "abc STx <en" and detok.stop_reason is None


def test_first_occurrence_wins(tiny_tok):
    text = "one two three four"
    ids = tiny_tok.encode(text)
    detok, _, matched = stream(tiny_tok, [], ids, stop=["four", "two", "three"])
    assert matched == "two" and detok.output_text == "one "
    # Both in one update: the match that ends first wins, as it would streaming char by char.
    detok = IncrementalDetokenizer(tiny_tok, [], stop=["abcd", "bc"])
    assert detok.update(tiny_tok.encode("xabcd")) == "bc"
    assert detok.output_text == "xa"
    # Same end: the longer one.
    detok = IncrementalDetokenizer(tiny_tok, [], stop=["d", "cd"], include_stop_str_in_output=True)
    assert detok.update(tiny_tok.encode("abcd")) == "cd"
    assert detok.output_text == "abcd"


def expected_stop(text, stops, include):
    """Reference: the earliest-ending match in the whole text (longest on ties)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i != -1:
            key = (i + len(s), -len(s), s)
            best = key if best is None else min(best, key)
    if best is None:
        return text, None
    end, neg_len, s = best
    return text[: end if include else end + neg_len], s


@pytest.mark.parametrize("tok_name", ["tiny_tok", "smol_tok"])
def test_random_stop_strings_match_reference(request, tok_name):
    """Random texts, stop strings (substrings of the text and not), chunkings and flags: the
    output is the full text cut at the stop string, whatever the chunking; nothing leaks."""
    tok = request.getfixturevalue(tok_name)
    rng = random.Random(2)
    corpus = "".join(SENTENCES)
    for _ in range(200):
        start = rng.randrange(len(corpus) - 40)
        text = corpus[start : start + rng.randint(5, 60)]
        ids = tok.encode(text)
        text = tok.decode(ids)  # what the tokens really spell
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.7:
                a = rng.randrange(len(text))
                stops.append(text[a : a + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(["zz", "Hello", "\n\n", "。", "🔥x", "the"]))
        include = rng.random() < 0.5
        want, want_stop = expected_stop(text, stops, include)
        chunks = random_chunks(rng, len(ids)) if rng.random() < 0.5 else None
        detok, deltas, matched = stream(
            tok, [], ids, chunks=chunks, stop=stops, include_stop_str_in_output=include
        )
        assert (detok.output_text, matched) == (want, want_stop), (text, stops, include)
        assert "".join(deltas) == want


# --- cost ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [[], ["<never>", "Question:"]])
def test_per_step_cost_is_o_new_tokens(smol_tok, stop):
    """2,000 steps: two decodes per step, each of a window of a few tokens, never the output."""
    text = "".join(SENTENCES) * 20
    ids = smol_tok.encode(text)[:2000]
    assert len(ids) == 2000
    counting = CountingTokenizer(smol_tok)
    prompt = smol_tok.encode("<|im_start|>assistant\n")
    detok = IncrementalDetokenizer(counting, prompt, stop=stop)
    counting.decode_lengths.clear()  # the constructor decodes the prompt's context once
    for i in ids:
        assert detok.update([i]) is None
    detok.finalize()
    assert detok.output_text == smol_tok.decode(ids)
    lengths = counting.decode_lengths
    assert len(lengths) <= 2 * len(ids)
    # A window holds the previous step's tokens and the new ones (a few more inside a
    # multi-token character such as a ZWJ emoji family).
    assert max(lengths) <= 12
    assert sum(lengths) <= 5 * len(ids)


def test_metaspace_first_token_keeps_its_space_after_a_prompt():
    """The documented difference from a standalone decode, shared with vLLM: the prompt is the
    decoding context, so a SentencePiece-style first token keeps its leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "▁Hi": 1, "▁world": 2, "!": 3}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    assert tok.decode([2, 3]) == "world!"
    assert stream(tok, [1], [2, 3])[0].output_text == " world!"
    assert stream(tok, [], [2, 3])[0].output_text == "world!"


def test_decode_options_of_the_tokenizer_apply():
    """A fast tokenizer is decoded through its backend only when transformers' decode would add
    nothing to it: with clean-up spaces on, the tokenizer's own decode runs, clean-up included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hi": 1, "▁there": 2, "▁.": 3}
    tokenizers = {}
    for clean_up in (False, True):
        backend = Tokenizer(models.WordLevel(vocab, "<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        tokenizers[clean_up] = PreTrainedTokenizerFast(
            tokenizer_object=backend, clean_up_tokenization_spaces=clean_up
        )
    ids = [2, 3, 1, 3]
    assert tokenizers[True].decode(ids) == "there. Hi."  # clean-up: " ." -> "."
    assert tokenizers[False].decode(ids) == "there . Hi ."
    for clean_up, tok in tokenizers.items():
        detok = stream(tok, [], ids)[0]
        assert detok.output_text == tok.decode(ids)
        assert (detok._decoder is tok.backend_tokenizer) is not clean_up


@pytest.mark.parametrize("tok_name", ["tiny_tok", "smol_tok"])
def test_deferred_text_equals_streamed_text(request, tok_name):
    """FINAL_ONLY outputs decode once at the end (or at a read) instead of twice a step: the
    same text as token by token, whatever the prompt context, special tokens and split
    characters; stop strings and clean-up tokenizers keep decoding per step."""
    tok = request.getfixturevalue(tok_name)
    rng = random.Random(2)
    for _ in range(150):
        ids = random_ids(rng, tok, rng.randint(0, 40))
        prompt = random_ids(rng, tok, rng.randint(0, 8))
        skip = rng.random() < 0.5
        streamed = stream(tok, prompt, ids, skip_special_tokens=skip)[0]
        deferred = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, deferred=True)
        assert deferred.deferred
        read_at = rng.randint(0, len(ids))  # a read mid-way decodes what came so far
        deferred.update(ids[:read_at])
        assert streamed.output_text.startswith(deferred.output_text)
        for token in ids[read_at:]:
            assert deferred.update([token]) is None
        deferred.finalize()
        assert deferred.output_text == streamed.output_text, (prompt, ids)
    assert not IncrementalDetokenizer(tok, [], stop=["a"], deferred=True).deferred


def test_deferred_metaspace_and_clean_up():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hi": 1, "▁there": 2, "▁.": 3}
    for clean_up in (False, True):
        backend = Tokenizer(models.WordLevel(vocab, "<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        tok = PreTrainedTokenizerFast(
            tokenizer_object=backend, clean_up_tokenization_spaces=clean_up
        )
        ids = [2, 3, 1, 3]
        deferred = IncrementalDetokenizer(tok, [1], deferred=True)
        assert deferred.deferred is not clean_up  # clean-up applies per window: per step
        deferred.update(ids)
        deferred.finalize()
        assert deferred.output_text == stream(tok, [1], ids)[0].output_text


def test_several_tokens_drop_those_after_a_stop_string(tiny_tok):
    """A step of several tokens (drafts, several decode steps) is decoded in one window; when a
    stop string completes inside it, the tokens after the one completing it are not kept."""
    ids = tiny_tok.encode("Hello, world! The quick brown fox")
    stop = "world"
    single = stream(tiny_tok, [], ids, stop=[stop])[0]
    many = IncrementalDetokenizer(tiny_tok, [], stop=[stop])
    assert many.update(ids) == stop
    assert many.output_text == single.output_text == "Hello, "
    assert many.output_token_ids == single.output_token_ids
    assert len(many.output_token_ids) < len(ids)
    # min_tokens: a match before them does not count, one after does, as token by token.
    late = IncrementalDetokenizer(tiny_tok, [], stop=["o"], min_tokens=len(ids) - 1)
    assert late.update(ids) == "o"
    want = stream(tiny_tok, [], ids, stop=["o"], min_tokens=len(ids) - 1)[0]
    assert late.output_token_ids == want.output_token_ids
