"""Deterministic toy language model and its token space (standard library only).

Token ids: 0..255 are bytes (prompts are tokenized byte by byte, so any text
round-trips), WORD_BASE.. are whole words the model generates (each decodes to
" word"), then the special tokens. The shipped tokenizer.json (demo/tokenizer)
encodes/decodes the same ids, so NVIDIA's clients and our models agree.
"""
import hashlib

_WORDS = (
    "the of and to in is was for on that with as by at from his her it an were "
    "are which this be or has had first one their its new after but who not they "
    "have two been other when there all during into school time may years more "
    "most only over city some world would where later up such used many can state "
    "about national out known university united then made team american game "
    "three under also season both group film age series between well while back "
    "same before year through part against early county north south played band "
    "became however until people named history war music several being each "
    "because since life work family number album called second top high due "
    "including four even five general club these without home member government "
    "river did based built public still another large long end within line final "
    "old local west release east party great along day single any "
    "led like began army best house around following took center "
    "model server token stream batch engine tensor kernel rank group health ready"
).split()
# Unique words only: a tokenizer vocabulary maps each token string to one id.
WORDS = tuple(dict.fromkeys(_WORDS))
WORD_BASE = 256
VOCAB_SIZE = len(WORDS)
BOS_ID = WORD_BASE + VOCAB_SIZE          # "<s>"
END_ID = BOS_ID + 1                      # "</s>": the tokenizer's eos, preprocessing's OUT_END_ID
PAD_ID = BOS_ID + 2                      # "<pad>"
SPECIAL = {BOS_ID: "<s>", END_ID: "</s>", PAD_ID: "<pad>"}
TOTAL_VOCAB = PAD_ID + 1


def encode(text):
    """Prompt text -> token ids (its UTF-8 bytes; at least one token)."""
    return list(text.encode("utf-8")) or [0]


def word_id(word):
    """The token id of a generated word, or None."""
    try:
        return WORD_BASE + WORDS.index(word)
    except ValueError:
        return None


def _candidate(seed, step, salt):
    h = hashlib.sha256(seed + step.to_bytes(4, "little") + salt.to_bytes(2, "little")).digest()
    return WORD_BASE + int.from_bytes(h[:4], "little") % VOCAB_SIZE


def prompt_seed(input_ids):
    return hashlib.sha256(b",".join(str(int(i)).encode() for i in input_ids)).digest()


def token_at(seed, step, banned=()):
    """The token generated at `step` for a prompt: a pure function of the prompt and
    the step, so the batch a request runs in never changes its tokens. `banned`
    (single-token bad words) are skipped by re-drawing with a salt."""
    for salt in range(64):
        tok = _candidate(seed, step, salt)
        if tok not in banned:
            return tok
    return tok


def next_tokens(input_ids, count, banned=()):
    """The first `count` tokens the toy model generates for `input_ids`."""
    seed = prompt_seed(input_ids)
    return [token_at(seed, s, banned) for s in range(count)]


def decode(token_ids, skip_special_tokens=True):
    """Token ids -> text: bytes are gathered and decoded as UTF-8, words become " word"."""
    out, pending = [], bytearray()
    for t in token_ids:
        t = int(t)
        if 0 <= t < WORD_BASE:
            pending.append(t)
            continue
        if pending:
            out.append(pending.decode("utf-8", "replace"))
            pending = bytearray()
        if WORD_BASE <= t < WORD_BASE + VOCAB_SIZE:
            out.append(" " + WORDS[t - WORD_BASE])
        elif t in SPECIAL and not skip_special_tokens:
            out.append(SPECIAL[t])
    if pending:
        out.append(pending.decode("utf-8", "replace"))
    return "".join(out)


def generate_text(prompt, max_tokens):
    """What the ensemble answers for `prompt` without the echoed prompt
    (exclude_input_in_output, or one streamed chunk per token joined)."""
    return decode(next_tokens(encode(prompt), max_tokens))
