"""BFCL's multi-turn tasks as agent programs: real task text, real tool documentation.

Each task of BFCL v4's multi-turn sets (base, long context, missing function, missing
parameter: 800 tasks, read from the ``bfcl-eval`` wheel as ``datasets`` reads it) is one
program: its system block the documentation of the task's tool classes (one block per set
of classes, so programs of one set share it exactly, as agents of one type do), then for
each user message the expected calls one turn each (the model's output: the call as BFCL
writes it; then the tool's output) and a closing answer (``stop``), after which the next
user message follows.  BFCL gives neither tool outputs nor times, so those, and the closing
answers' lengths, are drawn from ``AgentShape`` (``tool_output_tokens``, ``tool_s`` before
every turn but the first, also standing for the user's time, ``output_tokens``), seeded.
"""

from __future__ import annotations

import json
import random
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from feather_sched.workloads.agents import (
    STOP,
    TOOL_CALLS,
    AgentProgram,
    AgentShape,
    AgentWorkload,
    Step,
    chained,
)
from feather_sched.workloads.datasets import (
    bfcl_source,
    encode_texts,
    load_tokenizer,
    render_messages,
    tool_block,
)
from feather_sched.workloads.spec import (
    ArrivalSpec,
    arrival_times,
    check_positive,
    random_tokens,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SETS = ("base", "long_context", "miss_func", "miss_param")
"""BFCL v4's multi-turn sets (``BFCL_v4_multi_turn_<set>.json``), 200 tasks each."""
FUNC_DOCS = {
    "GorillaFileSystem": "gorilla_file_system.json", "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json", "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json", "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json", "VehicleControlAPI": "vehicle_control.json",
    "WebSearchAPI": "web_search.json", "MemoryAPI_kv": "memory_kv.json",
    "MemoryAPI_vector": "memory_vector.json", "MemoryAPI_rec_sum": "memory_rec_sum.json"}
"""Each tool class's documentation file: BFCL's own ``MULTI_TURN_FUNC_DOC_FILE_MAPPING``
(``bfcl_eval/constants/executable_backend_config.py``)."""


def bfcl_programs(*, programs: int, arrival: ArrivalSpec | None = None,
                  shape: AgentShape | None = None, source: str | Path | None = None,
                  tokenizer: str | Path | None = None, seed: int = 0) -> AgentWorkload:
    """``programs`` BFCL multi-turn tasks in seeded order (cycled past 800), starting as
    ``arrival`` says, tokenized by ``tokenizer`` (None: the embedded model's).  ValueError
    where the wheel or a file in it is missing.  Cost: reads about 10 MB from the wheel
    and tokenizes each task's text once."""
    check_positive(programs=programs)
    shape = shape or AgentShape()
    tasks, docs = _read(bfcl_source(None if source is None else Path(source)))
    random.Random(seed).shuffle(tasks)
    encoder, rng = load_tokenizer(tokenizer), np.random.default_rng(seed)
    types: dict[tuple[str, ...], int] = {}
    systems: list[np.ndarray] = []
    starts = arrival_times(programs, arrival, rng)
    made = []
    for index, start in enumerate(starts):
        task, answer = tasks[index % len(tasks)]
        classes = tuple(sorted(task["involved_classes"]))
        if classes not in types:
            types[classes] = len(systems)
            systems.append(encode_texts(encoder, [_tool_block(classes, docs)], True)[0])
        made.append(_program(index, types[classes], float(start), systems[types[classes]],
                             task, answer, encoder, shape, rng))
    return AgentWorkload("bfcl-multi-turn", made)


def _read(source: Path) -> tuple[list[tuple[dict, list]], dict[str, list[dict]]]:
    """The tasks with their expected calls, and each tool class's documentation."""
    if source.suffix != ".whl":
        raise ValueError(f"BFCL's multi-turn programs read the bfcl-eval wheel, not {source}")
    with zipfile.ZipFile(source) as wheel:
        def lines(name: str) -> list[dict]:
            try:
                text = wheel.read(f"bfcl_eval/data/{name}").decode()
            except KeyError:
                raise ValueError(f"{source} holds no bfcl_eval/data/{name}") from None
            return [json.loads(line) for line in text.splitlines() if line.strip()]

        tasks = []
        for name in SETS:
            file = f"BFCL_v4_multi_turn_{name}.json"
            answers = {a["id"]: a["ground_truth"] for a in lines(f"possible_answer/{file}")}
            tasks += [(task, answers[task["id"]]) for task in lines(file)]
        docs = {cls: lines(f"multi_turn_func_doc/{file}") for cls, file in FUNC_DOCS.items()}
    return tasks, docs


def _tool_block(classes: tuple[str, ...], docs: dict[str, list[dict]]) -> str:
    """The system block: the header and the classes' functions, as ``bfcl-tools`` renders
    them (all of them: the block is the classes', shared by their tasks)."""
    return tool_block([doc for cls in classes for doc in docs[cls]])


def _program(index: int, agent_type: int, start_s: float, system: np.ndarray, task: dict,
             answer: list, encoder: Tokenizer, shape: AgentShape,
             rng: np.random.Generator) -> AgentProgram:
    """One task's turns: per user message, a turn per expected call, then a closing one."""
    messages = [render_messages(turn) for turn in task["question"]]
    calls = [list(turn_calls) for turn_calls in answer]
    texts = encode_texts(encoder, messages + [c for turn in calls for c in turn], False)
    said, written = texts[:len(messages)], iter(texts[len(messages):])
    vocab, steps = encoder.get_vocab_size(), []
    for turn, turn_calls in enumerate(calls):
        closing = random_tokens(rng, int(shape.output_tokens.draw(rng, 1)[0]), vocab)
        outputs = [*(next(written) for _ in turn_calls), closing]
        for k, output in enumerate(outputs):
            last = k == len(outputs) - 1
            then = said[turn + 1] if last and turn + 1 < len(said) else random_tokens(
                rng, int(shape.tool_output_tokens.draw(rng, 1)[0]), vocab)
            before = float(shape.tool_s.draw(rng, 1)[0]) if steps else 0.0
            steps.append(Step(output, then, before, STOP if last else TOOL_CALLS))
    return chained(index, agent_type, start_s, system, said[0], steps)
