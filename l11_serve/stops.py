"""Token ids in, text out, stop strings found on the text (lesson L11, §2.4 "Stop strings").

A stop string is text, and tokens do not line up with text: "Amen." arrives as "A" + "men" + "."
or inside one token ". Amen.\n". So the matcher turns the tokens into text as they come, searches
the new text for each stop string, and never sends text that could still become the start of a
stop string (it holds that tail back until the next token decides). A token that ends in the
middle of a multi-byte character decodes to U+FFFD; that text is not final either and waits for
the next.

Turning tokens into text is incremental (`IncrementalDecoder`, vLLM's detokenizer's scheme): each
token costs the decode of a few tokens, not of everything generated so far. Decoding the whole
output at every step made the time between two chunks grow with the output's length (12 ms at
the start of a stream, 33 ms by its 1,000th token).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a tokenizer decodes half a UTF-8 character to


class IncrementalDecoder:
    """The text of a growing list of ids, a few tokens' decode per token.

    vLLM's two offsets: ids[read_offset:] are the unread ids (their text is not out yet);
    ids[prefix_offset:read_offset] are a few ids already read, decoded only as context. A token's
    text depends on its neighbours (a SentencePiece tokenizer drops the leading space of the first
    token it decodes; a byte-level one needs every byte of a character), so the unread ids' text
    is decode(context + unread) minus decode(context), never decode(unread) alone. The read offset
    only moves to a point where the text ends on a whole character, so the context's own text is
    final there and is a prefix of the longer decode.
    """

    CONTEXT = 5  # ids of context before the unread ones (vLLM starts its prefix offset 5 back too)

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self._context = (0, 0, "")  # (prefix_offset, read_offset, its text): decoded once per move

    def add(self, token: int) -> str:
        """The text of every unread id, this one included. While it ends in U+FFFD (a character
        not complete yet) the ids stay unread and the next call returns their text again, longer;
        otherwise they are read, and the next call starts after them."""
        self.ids.append(token)
        text = self.unread_text()
        if not text.endswith(REPLACEMENT):
            self.read_offset = len(self.ids)
            self.prefix_offset = max(0, self.read_offset - self.CONTEXT)
        return text

    def finish(self) -> str:
        """At the end: the unread ids' text, an incomplete character's U+FFFD included (as decoding
        everything shows it); they count as read."""
        text = self.unread_text()
        self.read_offset = self.prefix_offset = len(self.ids)
        return text

    def unread_text(self) -> str:
        if self._context[:2] != (self.prefix_offset, self.read_offset):
            self._context = (self.prefix_offset, self.read_offset,
                             self._decode(self.ids[self.prefix_offset:self.read_offset]))
        return self._decode(self.ids[self.prefix_offset:])[len(self._context[2]):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


class StopMatcher:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.decoder = IncrementalDecoder(tokenizer)  # the new tokens' text, a few tokens' decode each
        # Decoded text not handed out yet, up to the stop string when one was found. What was sent
        # is dropped: it cannot hold a stop string's beginning (see _held_back), and keeping it
        # would make each token's work grow with the output.
        self.text = ""
        self.num_tokens = 0  # tokens that count as output: all fed, or up to the one completing a stop
        self.stopped = False

    def feed(self, token_ids: list[int]) -> str:
        """Take one step's new tokens; return the text that is now safe to send (maybe "").
        After a stop string is found, `stopped` is True, the text ends just before the stop string,
        and later calls return ""."""
        # BEGIN SOLUTION
        for token in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            text = self.text + self.decoder.add(token)
            if text.endswith(REPLACEMENT):
                continue  # half a character: decide when the rest arrives
            self.text = text
            at = self._find_stop()
            if at is not None:
                self.text, self.stopped = text[:at], True
        safe = len(self.text) if self.stopped else len(self.text) - self._held_back()
        out, self.text = self.text[:safe], self.text[safe:]
        return out
        # END SOLUTION

    def _find_stop(self) -> int | None:
        """Index in `text` where the earliest stop string begins."""
        found = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is the beginning of some stop string."""
        return max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)

    def flush(self) -> str:
        """At the end of generation: the text held back (it turned out not to be a stop string),
        and the text of tokens still waiting for the rest of a character."""
        if self.stopped:
            return ""
        out, self.text = self.text + self.decoder.finish(), ""
        return out
