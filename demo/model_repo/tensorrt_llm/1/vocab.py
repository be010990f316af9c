"""Deterministic toy "language model" shared by the demo models (no imports
beyond the standard library, so tests can use it to predict outputs)."""
import hashlib

WORDS = (
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
    "old local west release east music party great along day single any great "
    "led like began army best house including around following took around center "
    "model server token stream batch engine tensor kernel rank group health ready"
).split()
VOCAB_SIZE = len(WORDS)


def next_tokens(input_ids, count):
    """The `count` tokens the toy model generates for `input_ids` (list of ints)."""
    seed = hashlib.sha256(bytes(int(i) & 0xFF for i in input_ids)).digest()
    out = []
    for step in range(count):
        h = hashlib.sha256(seed + step.to_bytes(4, "little")).digest()
        out.append(int.from_bytes(h[:4], "little") % VOCAB_SIZE)
    return out


def decode(token_ids):
    return "".join(" " + WORDS[int(t) % VOCAB_SIZE] for t in token_ids)


def generate_text(prompt, max_tokens):
    """What the ensemble answers for `prompt` (non-streamed text_output)."""
    ids = list(prompt.encode("utf-8")) or [0]
    return decode(next_tokens(ids, max_tokens))
