"""Token ids in, text out, stop strings found on the text (lesson L11, §2.4 "Stop strings").

A stop string is text, and tokens do not line up with text: "Amen." arrives as "A" + "men" + "."
or inside one token ". Amen.\n". So the matcher decodes everything generated so far, searches the
new text for each stop string, and never sends text that could still become the start of a stop
string (it holds that tail back until the next token decides). A token that ends in the middle of
a multi-byte character decodes to U+FFFD; that text is not final either and waits for the next.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a tokenizer decodes half a UTF-8 character to


class StopMatcher:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []  # every token fed so far
        self.text = ""  # their decoded text, up to the stop string when one was found
        self.sent = 0  # characters of `text` already handed out
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
            self.ids.append(token)
            self.num_tokens = len(self.ids)
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if text.endswith(REPLACEMENT):
                continue  # half a character: decide when the rest arrives
            self.text = text
            at = self._find_stop(start=self.sent)  # sent text held no stop (nor a stop's beginning)
            if at is not None:
                self.text, self.stopped = text[:at], True
        safe = len(self.text) if self.stopped else len(self.text) - self._held_back()
        out = self.text[self.sent:safe]
        self.sent = max(self.sent, safe)
        return out
        # END SOLUTION

    def _find_stop(self, start: int) -> int | None:
        """Index in `text` where the earliest stop string begins, searching from `start`."""
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is the beginning of some stop string."""
        return max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)

    def flush(self) -> str:
        """At the end of generation: the text held back (it turned out not to be a stop string)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        out, self.sent, self.text = text[self.sent:], len(text), text
        return out
