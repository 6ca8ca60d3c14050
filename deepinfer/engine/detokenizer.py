"""Incremental detokenisation and stop-string search, vLLM's way: each step decodes a short window of
the newest tokens, so a sequence's text costs time linear in its length, not quadratic."""

# What a decoder makes of a UTF-8 sequence that is cut short; the next tokens may still complete it.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """The text of one sequence's output, grown as tokens arrive.

    Decoding tokens[prefix_offset:] and tokens[prefix_offset:read_offset] and keeping what the first
    adds to the second yields the text of the tokens from read_offset on, decoded in the context of a
    few tokens before them (a SentencePiece decoder drops the space of a window's first token, and both
    windows start with the same token, so the difference keeps the spaces a full decode keeps).

    It starts without context, where vLLM starts from the prompt's last tokens, so that the text is
    tokenizer.decode(output_ids): that too drops the space of the first output token.

    Where a full decode rewrites text already emitted, the text is what vLLM returns, the emitted
    pieces joined. Two such cases: clean_up_tokenization_spaces (" ." -> "." across a token border),
    which the windows therefore leave off as vLLM's do (transformers skips it for BPE tokenizers, so
    the tokenizers the tests use are unaffected); and a byte-fallback decoder (SentencePiece's <0x..>
    tokens), which turns a whole run of byte tokens into U+FFFDs once one byte in it is invalid UTF-8,
    so characters emitted from the run before that byte arrived stay."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.prefix_offset = 0  # tokens[prefix_offset:read_offset] are in text already: context only
        self.read_offset = 0  # tokens from here on are not in text yet

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """token_ids: the sequence's whole output so far; only the tokens from prefix_offset on are
        decoded. Appends the text the new tokens complete to self.text and returns it. Text ending in an
        incomplete character, or no text yet, waits for the next tokens unless final (no tokens follow)."""
        prefix_text = self._decode(token_ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(token_ids[self.prefix_offset:])
        new_text = window_text[len(prefix_text):]
        # Waiting on empty text too keeps the context non-empty: a window of only skipped special
        # tokens would let a SentencePiece decoder drop the space of the next token.
        if not final and (not new_text or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.text += new_text
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """text: the output so far, of which the last num_new_chars characters arrived since the previous
    search; stops: non-empty strings. Returns (position, stop) of the first stop string in text, the
    smallest string where several start at one position, or None.

    The previous searches found no stop string, so one now must end in the new characters: only those
    and the max(len(stop)) - 1 characters before them are searched."""
    if not num_new_chars:
        return None
    start = max(0, len(text) - num_new_chars - max(map(len, stops)) + 1)
    hits = [(pos, stop) for stop in stops if (pos := text.find(stop, start)) >= 0]
    return min(hits, default=None)
