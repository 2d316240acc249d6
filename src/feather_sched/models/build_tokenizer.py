"""Build the embedded model's tokenizer: ``python -m feather_sched.models.build_tokenizer``.

The embedded tiny Llama has random weights, so its tokenizer only has to be a real one
of the right size: with it vLLM checks token ids against the vocabulary (an
out-of-vocabulary id is a 400, not a crashed worker), and text prompts and
``/v1/chat/completions`` work against ``feather serve``.  A byte-level BPE (the
``tokenizers`` library) is trained on text that every Python install carries (the
standard library's docstrings), then padded with reserved tokens (vocabulary entries no
merge produces) to exactly the model's ``vocab_size``.  The result is committed next to
``config.json``; this script documents how it was made and rebuilds it.
"""

from __future__ import annotations

import json
import pkgutil
from importlib import import_module
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from feather_sched.models import TINY_LLAMA

SPECIAL = ["<unk>", "<s>", "</s>"]
"""Ids 0, 1, 2: the config's bos_token_id 1 and eos_token_id 2."""
CHAT = ["<|system|>", "<|user|>", "<|assistant|>"]
"""The chat template's role markers: the last ids."""
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
STDLIB = ("abc", "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses",
          "datetime", "decimal", "email", "enum", "functools", "heapq", "http", "inspect",
          "itertools", "json", "logging", "math", "os", "pathlib", "pickle", "random", "re",
          "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "textwrap",
          "threading", "typing", "unittest", "urllib", "uuid", "zipfile")


def corpus() -> list[str]:
    """Docstrings of standard-library modules and their members, in a fixed order."""
    texts = []
    for name in STDLIB:
        module = import_module(name)
        texts.append(module.__doc__ or "")
        for attribute in sorted(dir(module)):
            doc = getattr(getattr(module, attribute, None), "__doc__", None)
            if isinstance(doc, str):
                texts.append(doc)
        for sub in sorted(m.name for m in pkgutil.iter_modules(getattr(module, "__path__", []))):
            texts.append(f"{name}.{sub}")
    return [t for t in texts if t]


def build(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(CHAT), special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer)
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for i in range(vocab_size - len(CHAT) - len(vocab)):
        vocab[f"<|reserved_{i}|>"] = len(vocab)
    tokenizer = Tokenizer.from_str(json.dumps(data))
    tokenizer.add_special_tokens(CHAT)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"built {tokenizer.get_vocab_size()} tokens, need {vocab_size}")
    return tokenizer


def main(directory: Path = TINY_LLAMA) -> None:
    vocab_size = json.loads((directory / "config.json").read_text())["vocab_size"]
    build(vocab_size).save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 32768,
              "add_bos_token": True, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {directory}/tokenizer.json ({vocab_size} tokens) and tokenizer_config.json")


if __name__ == "__main__":
    main()
