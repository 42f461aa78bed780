"""A small rule-based sentence splitter for ``--split-sentences`` (BERT data); no model, no downloads.

Rules, in full:

* a sentence ends after a run of ``.``, ``!`` or ``?``, optional closing quotes or brackets and
  whitespace, when the next character is not a lowercase letter, the word carrying the
  period is not a known abbreviation (``Mr.``, ``e.g.``, ...) and not a single-letter initial;
* a blank line always ends a sentence (paragraph break);
* whitespace stays with the sentence before it, so the sentences concatenate back to the text
  exactly and a lossless tokenizer keeps the document byte for byte.
"""

from __future__ import annotations

import re

ABBREVIATIONS = frozenset("""mr. mrs. ms. dr. prof. sr. jr. st. vs. etc. e.g. i.e. cf. al. fig. no. vol. pp.
    approx. dept. inc. ltd. co. jan. feb. mar. apr. jun. jul. aug. sep. sept. oct. nov. dec.""".split())

_SENTENCE_END = re.compile(r"[.!?]+[)\]\"'\u2019\u201d]*\s+")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_LAST_WORD = re.compile(r"\S+$")
_LONGEST_WORD = 40  # characters looked at before a period; abbreviations are far shorter


def _ends_sentence(text: str, punctuation_start: int, end: int) -> bool:
    if end >= len(text) or text[end].islower():
        return False
    window_start = max(0, punctuation_start - _LONGEST_WORD)
    word = _LAST_WORD.search(text, window_start, punctuation_start + 1).group().lstrip("([\"'\u2018\u201c").lower()
    is_initial = len(word) == 2 and word[0].isalpha() and word[1] == "."
    return word not in ABBREVIATIONS and not is_initial


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences whose concatenation is ``text``; blank text gives ``[]``."""
    boundaries = {m.end() for m in _PARAGRAPH_BREAK.finditer(text)}
    boundaries |= {m.end() for m in _SENTENCE_END.finditer(text) if _ends_sentence(text, m.start(), m.end())}
    sentences, start = [], 0
    for boundary in sorted(boundaries | {len(text)}):
        if boundary > start:
            sentences.append(text[start:boundary])
            start = boundary
    if sentences and not sentences[0].strip() and len(sentences) > 1:
        sentences[1] = sentences[0] + sentences[1]
        sentences.pop(0)
    return [] if not text.strip() else sentences
