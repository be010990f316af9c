"""The tiny tokenizer directory NVIDIA's clients load (`tokenizer_dir`), generated
from twin.tokens so the files and the models can never disagree.

A byte-level BPE with no merges: encoding any text gives its UTF-8 bytes as ids
0..255 (what our preprocessing produces), and decoding maps the generated word ids
back to " word". `transformers.AutoTokenizer.from_pretrained(dir)` loads it offline.
    python -m twin.tokenizer_files DIR     (run from demo/) writes the files.
"""
import json
import sys
from pathlib import Path

from . import tokens


def _byte_chars():
    # GPT-2's reversible byte -> printable character table, which the ByteLevel
    # pre-tokenizer and decoder of the `tokenizers` library use.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def tokenizer_json():
    chars = _byte_chars()
    vocab = {chars[b]: b for b in range(256)}
    for i, word in enumerate(tokens.WORDS):
        vocab["".join(chars[b] for b in (" " + word).encode())] = tokens.WORD_BASE + i
    added = []
    for tid, text in sorted(tokens.SPECIAL.items()):
        vocab[text] = tid
        added.append({"id": tid, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


# A Zephyr-style chat template, so the OpenAI API's /v1/chat/completions has one to render
# (it reads chat_template from tokenizer_config.json, as Hugging Face's tokenizers do).
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
                 "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def tokenizer_config():
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "pad_token": "<pad>", "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE}


def files():
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    return {"tokenizer.json": tokenizer_json(), "tokenizer_config.json": tokenizer_config(),
            "special_tokens_map.json": special}


def write(directory):
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name, content in files().items():
        (d / name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    write(sys.argv[1])
