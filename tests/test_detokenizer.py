"""Incremental detokenisation: the pieces join to the full decode, stop strings are found where a full
search finds them, and the decoding cost grows linearly with the output."""
import json
import random

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.default_model import smollm2_path
from deepinfer.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from deepinfer.models.loader import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

# Characters of 2 to 4 UTF-8 bytes: every test tokenizer splits some of them across tokens.
MULTIBYTE = ["😀", "🎉👍", " 日本語", "中文字", "naïve café", "Ωμέγα", " 🙂 ok"]


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2's GGUF's tokenizer: byte-level BPE, 49152 tokens."""
    return load_tokenizer(smollm2_path())


@pytest.fixture(scope="module")
def byte_level(tiny_llama):
    """The tiny byte-level BPE tokenizer conftest trains for the tiny models."""
    return load_tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def sentencepiece():
    """A Llama-style tokenizer trained here: words start with "▁" for their space, <0x..> byte-fallback
    tokens stand for characters outside the vocabulary, and the decoder strips the text's leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, stop here. the end", "日本語"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    for byte in range(256):  # the trainer makes no byte tokens; byte fallback needs all 256
        spec["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(spec["model"]["vocab"]))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


@pytest.fixture(params=["smollm2", "byte_level", "sentencepiece"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


class CountingTokenizer:
    """A tokenizer whose decode counts the token ids it is given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.num_decoded = 0

    def decode(self, token_ids, **kwargs):
        self.num_decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def random_vocab(tokenizer) -> list[int]:
    """Ids to draw random tokens from. Byte-fallback tokens are left out: a random run of them is
    invalid UTF-8, where the decoder rewrites text already emitted (see IncrementalDetokenizer)."""
    return [i for token, i in tokenizer.get_vocab().items() if not token.startswith("<0x")]


def random_output(tokenizer, rng: random.Random, vocab: list[int]) -> list[int]:
    """Random tokens (special ones included) with tokenised multi-byte text spliced in."""
    ids = []
    for _ in range(rng.randint(1, 10)):
        ids += [rng.choice(vocab) for _ in range(rng.randint(0, 8))]
        ids += tokenizer.encode(rng.choice(MULTIBYTE), add_special_tokens=False)
    return ids


def pieces(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    """Feeds ids a step at a time (1 to 3 tokens per step, as speculative decoding makes, when rng is
    given) and returns each step's text, the final one's last."""
    out, n = [], 0
    while n < len(ids):
        n = min(len(ids), n + (rng.choice([1, 1, 2, 3]) if rng else 1))
        out.append(detok.update(ids[:n]))
    out.append(detok.update(ids, final=True))
    return out


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_pieces_join_to_the_full_decode(tokenizer, skip_special_tokens):
    vocab = random_vocab(tokenizer)
    for seed in range(25):
        rng = random.Random(seed)
        ids = random_output(tokenizer, rng, vocab)
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        steps = pieces(detok, ids, rng)
        assert "".join(steps) == detok.text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert not any(s.endswith("\ufffd") for s in steps[:-1]), "an incomplete character was emitted"


def test_a_character_split_across_tokens_waits_until_complete(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    assert pieces(IncrementalDetokenizer(tokenizer, True), ids) == [""] * (len(ids) - 1) + ["😀", ""]


def test_a_skipped_special_token_keeps_the_next_tokens_space(sentencepiece):
    # Decoded alone, the "▁the" after the skipped <s> would lose its space as a window's first word.
    ids = sentencepiece.convert_tokens_to_ids(["▁quick", "<s>", "▁the"])
    assert pieces(IncrementalDetokenizer(sentencepiece, True), ids) == ["quick", "", " the", ""]


def test_final_update_emits_an_incomplete_character(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]
    steps = pieces(IncrementalDetokenizer(tokenizer, True), ids)
    assert steps[-1].endswith("\ufffd") and "".join(steps) == tokenizer.decode(ids)


def first_stop(tokenizer, ids: list[int], stops: list[str]) -> tuple[int, int, str] | None:
    """Detokenises ids a token at a time as the engine does; returns (step, position, stop) of the first
    stop string found, or None."""
    detok = IncrementalDetokenizer(tokenizer, True)
    for n in range(1, len(ids) + 1):
        new_text = detok.update(ids[:n])
        hit = find_stop_string(detok.text, len(new_text), stops)
        if hit:
            return (n, *hit)
    return None


def test_stop_string_across_tokens_is_found_at_the_token_that_completes_it(tokenizer):
    text = "hello world, stop here. the end"
    ids = tokenizer.encode(text, add_special_tokens=False)
    step, pos, stop = first_stop(tokenizer, ids, ["the end", "stop here"])
    assert (pos, stop) == (text.index("stop here"), "stop here")
    assert "stop here" in tokenizer.decode(ids[:step]) and "stop here" not in tokenizer.decode(ids[:step - 1])


def test_stop_string_in_the_first_token(smollm2):
    ids = smollm2.encode("hello world", add_special_tokens=False)
    assert first_stop(smollm2, ids, ["ell", "world"]) == (1, 1, "ell")


def test_stop_string_made_of_split_characters(smollm2):
    ids = smollm2.encode("ok 日本語 done", add_special_tokens=False)
    step, pos, stop = first_stop(smollm2, ids, ["本語 d"])
    assert (pos, stop) == ("ok 日本語 done".index("本語 d"), "本語 d")


def test_stop_search_spans_the_old_new_border_and_no_further():
    # "abcdef" was searched before; "XY" is new. A stop string may start up to len(stop) - 1 back.
    assert find_stop_string("abcdefXY", 2, ["efX"]) == (4, "efX")
    assert find_stop_string("abcdefXY", 2, ["fXY", "Y"]) == (5, "fXY")
    # Text before that window was searched already, so a stop string there is not looked for.
    assert find_stop_string("abcdefXY", 2, ["abc"]) is None
    assert find_stop_string("abcdefXY", 0, ["XY"]) is None


def test_stop_search_picks_the_earliest_then_the_smallest():
    assert find_stop_string("xabab", 5, ["b", "ab"]) == (1, "ab")
    assert find_stop_string("xabab", 5, ["ab", "a"]) == (1, "a")


def test_decoding_cost_is_linear(smollm2):
    counting = CountingTokenizer(smollm2)
    rng = random.Random(0)
    vocab = random_vocab(smollm2)
    ids = [rng.choice(vocab) for _ in range(2000)]
    detok = IncrementalDetokenizer(counting, True)
    for n in range(1, len(ids) + 1):
        new_text = detok.update(ids[:n])
        assert find_stop_string(detok.text, len(new_text), ["\x00never\x00"]) is None
    detok.update(ids, final=True)
    assert detok.text == smollm2.decode(ids, skip_special_tokens=True)
    assert counting.num_decoded < 10 * len(ids)


def test_engine_text_is_the_full_decode_at_linear_cost(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=16 << 20)
    counting = llm.engine.tokenizer = CountingTokenizer(llm.engine.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, stop=["\x00never\x00"])
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 400
    assert out.text == counting.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert counting.num_decoded < 10 * len(out.token_ids)
