"""What of an exception's message reaches a results table: whole sentences, never a line cut in
the middle. The unit log keeps the full traceback; this is the summary a user reads first."""
from __future__ import annotations

import re

MAX_CHARS = 600  # a results cell; longer messages end at the last whole sentence (or word) before it
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# A message some library cut itself, mid-sentence ("... This may occur when "): its unfinished tail goes.
_DANGLING = re.compile(r"\b(when|if|because|the|a|an|of|to|and|or|that|with|for|in|on|by|as|is|are)$", re.IGNORECASE)


def summary(e: BaseException | str) -> str:
    """The message's first paragraph as whole sentences: wrapped lines joined, at most MAX_CHARS,
    an unfinished trailing fragment dropped. The exception's type name if it says nothing."""
    text = str(e).strip()
    if not text:
        return type(e).__name__ if isinstance(e, BaseException) else ""
    paragraph = " ".join(line.strip() for line in re.split(r"\n\s*\n", text)[0].splitlines())
    sentences = _SENTENCE_END.split(paragraph)
    if len(sentences) > 1 and not sentences[-1].endswith((".", "!", "?", ")", "]", "'", '"')) \
            and (_DANGLING.search(sentences[-1]) or str(e).endswith(" ")):
        sentences = sentences[:-1]
    kept = ""
    for sentence in sentences:
        if kept and len(kept) + 1 + len(sentence) > MAX_CHARS:
            break
        kept = f"{kept} {sentence}" if kept else sentence
    if len(kept) > MAX_CHARS:  # one sentence longer than a cell: cut at a word, and say so
        kept = kept[:MAX_CHARS].rsplit(" ", 1)[0] + " …"
    return kept
