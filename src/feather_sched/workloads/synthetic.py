"""Seedable generators of workloads with a controlled prefix structure: shared-prefix groups,
minority groups, a singleton before a stream, long documents with many questions,
multi-turn chats, tenants of unequal habits, document tenants beside an interactive one,
and a no-sharing control (token ids never 0)."""

import math
from collections import Counter
from collections.abc import Sequence
from typing import Literal

import numpy as np

from feather_sched.workloads.spec import (
    DEFAULT_TENANT,
    ArrivalSpec,
    RequestSpec,
    Workload,
    arrival_times,
    check_choice,
    check_jitter,
    check_positive,
    check_range,
    check_vocab,
    random_tokens,
)

Order = Literal["shuffled", "grouped"]
Popularity = Literal["uniform", "zipf"]



def _distinct_sequences(
    rng: np.random.Generator, lengths: Sequence[int], vocab_size: int
) -> list[np.ndarray]:
    """Draw one random sequence per length, redrawing repeats so that all are distinct.

    Guarantees e.g. that no two suffixes collide even when they are a single token long.
    """
    for length, count in Counter(int(n) for n in lengths).items():
        # (vocab-1)**64 already exceeds any feasible count unless vocab_size == 2.
        if count > (vocab_size - 1) ** min(length, 64):
            raise ValueError(
                f"cannot draw {count} distinct {length}-token sequences from "
                f"{vocab_size - 1} token ids; raise vocab_size or the length"
            )
    seen: set[bytes] = set()
    sequences = []
    for length in lengths:
        seq = random_tokens(rng, int(length), vocab_size)
        while seq.tobytes() in seen:
            seq = random_tokens(rng, int(length), vocab_size)
        seen.add(seq.tobytes())
        sequences.append(seq)
    return sequences


def _jittered(rng: np.random.Generator, base: int, jitter: float, n: int) -> np.ndarray:
    """Integers drawn uniformly from [base*(1-jitter), base*(1+jitter)], each at least 1."""
    eps = 1e-9  # keep e.g. 10*(1-0.3) from rounding up to 8 through float error
    low = max(1, math.ceil(base * (1 - jitter) - eps))
    high = math.floor(base * (1 + jitter) + eps)
    return rng.integers(low, high, size=n, endpoint=True)


def _arrange(rng: np.random.Generator, labels: np.ndarray, order: Order) -> np.ndarray:
    """Keep grouped labels in order, or shuffle them."""
    return labels if order == "grouped" else rng.permutation(labels)


def _build(
    name: str,
    parts: Sequence[tuple[np.ndarray, int, int, int]],
    arrivals: np.ndarray,
    tenants: Sequence[str] | None = None,
) -> Workload:
    """Turn (prompt, output_len, group, shared_len) tuples plus arrival times (and each
    request's tenant, default ``DEFAULT_TENANT``) into a workload."""
    tenants = tenants or [DEFAULT_TENANT] * len(parts)
    requests = [
        RequestSpec(f"{name}-{i}", prompt, int(out), float(t), int(group), int(shared),
                    tenant=tenant)
        for i, ((prompt, out, group, shared), t, tenant) in enumerate(
            zip(parts, arrivals, tenants, strict=True))
    ]
    return Workload(name, requests)


# --------------------------------------------------------------------------- generators


def shared_prefix_groups(
    *,
    groups: int,
    prompts_per_group: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    jitter: float = 0.0,
    order: Order = "shuffled",
    popularity: Popularity = "uniform",
    zipf_s: float = 1.1,
    arrival: ArrivalSpec | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Workload:
    """Groups of prompts that share a per-group prefix and differ in a unique suffix.

    The core prefix-caching scenario (few-shot templates, shared system prompts). With
    ``popularity="zipf"`` the same total of ``groups * prompts_per_group`` prompts is spread
    over groups with weight ``1/rank**zipf_s`` (each group keeps at least one), which
    models a skewed mix of hot and cold prefixes.
    """
    check_positive(
        groups=groups,
        prompts_per_group=prompts_per_group,
        prefix_len=prefix_len,
        suffix_len=suffix_len,
        output_len=output_len,
    )
    check_jitter(jitter)
    check_choice("order", order, ("shuffled", "grouped"))
    check_choice("popularity", popularity, ("uniform", "zipf"))
    if not (math.isfinite(zipf_s) and zipf_s > 0):
        raise ValueError(f"zipf_s must be finite and > 0, got {zipf_s}")
    check_vocab(vocab_size)

    rng = np.random.default_rng(seed)
    total = groups * prompts_per_group
    if popularity == "uniform":
        sizes = np.full(groups, prompts_per_group)
    else:
        weights = 1.0 / np.arange(1, groups + 1) ** zipf_s
        extra = rng.choice(groups, size=total - groups, p=weights / weights.sum())
        sizes = 1 + np.bincount(extra, minlength=groups)
    return _prefix_groups("shared-prefix", rng, sizes, [prefix_len] * groups, suffix_len,
                          output_len, jitter, order, arrival, vocab_size)


def minority_groups(
    *,
    majority: int,
    minorities: Sequence[int],
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    arrival: ArrivalSpec | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
    minority_prefix_len: int | None = None,
) -> Workload:
    """One large prefix group and small ones, shuffled together: where prefix-first order
    starves the minority (group 0 is the majority, groups 1.. the minorities, whose
    prefixes are ``minority_prefix_len`` long; default ``prefix_len``)."""
    minority_prefix_len = prefix_len if minority_prefix_len is None else minority_prefix_len
    check_positive(majority=majority, prefix_len=prefix_len, suffix_len=suffix_len,
                    output_len=output_len, minority_prefix_len=minority_prefix_len)
    if not minorities or min(minorities) <= 0:
        raise ValueError(f"minorities must be positive group sizes, got {list(minorities)}")
    check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    sizes = np.array([majority, *minorities])
    prefix_lens = [prefix_len] + [minority_prefix_len] * len(minorities)
    return _prefix_groups("minority", rng, sizes, prefix_lens, suffix_len, output_len, 0.0,
                          "shuffled", arrival, vocab_size)


def singleton_before_a_stream(
    *,
    stream: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    singleton_output_len: int,
    arrival: ArrivalSpec,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Workload:
    """A singleton (its own prefix) that arrives first, then a stream of ``stream``
    requests of one prefix group: where preempting the end of a group-ordered batch makes
    the oldest request pay (group 0 is the stream, the singleton has no group)."""
    check_positive(stream=stream, prefix_len=prefix_len, suffix_len=suffix_len,
                    output_len=output_len, singleton_output_len=singleton_output_len)
    check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    singleton = random_tokens(rng, prefix_len + suffix_len, vocab_size)
    prefix = random_tokens(rng, prefix_len, vocab_size)
    parts = [(singleton, singleton_output_len, -1, 0)]
    parts += [(np.concatenate([prefix, random_tokens(rng, suffix_len, vocab_size)]), output_len, 0,
               prefix_len) for _ in range(stream)]
    later = arrival_times(stream, arrival, rng) + 1e-3  # strictly after the singleton
    return _build("singleton-before-a-stream", parts, np.concatenate([[0.0], later]))


def _prefix_groups(kind: str, rng: np.random.Generator, sizes: np.ndarray,
                   prefix_lens: Sequence[int], suffix_len: int, output_len: int,
                   jitter: float, order: Order, arrival: ArrivalSpec | None,
                   vocab_size: int) -> Workload:
    """Group ``g`` of ``sizes[g]`` prompts: a shared prefix of ``prefix_lens[g]`` tokens,
    then a unique suffix."""
    total = int(sizes.sum())
    members = _arrange(rng, np.repeat(np.arange(len(sizes)), sizes), order)
    prefixes = _distinct_sequences(rng, prefix_lens, vocab_size)
    suffixes = _distinct_sequences(rng, _jittered(rng, suffix_len, jitter, total), vocab_size)
    outputs = _jittered(rng, output_len, jitter, total)
    parts = [
        (np.concatenate([prefixes[g], suffix]), out, g, prefix_lens[g])
        for g, suffix, out in zip(members, suffixes, outputs, strict=True)
    ]
    return _build(kind, parts, arrival_times(total, arrival, rng))


def long_documents(
    *,
    documents: int,
    questions_per_document: int,
    doc_len_range: tuple[int, int] = (4096, 16384),
    question_len: tuple[int, int] = (16, 64),
    output_len: int,
    order: Order = "shuffled",
    arrival: ArrivalSpec | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Workload:
    """Several questions about each long document (LongBench / L-Eval style).

    Each prompt is a document followed by a question; the document is the shared prefix,
    so a cache hit saves thousands of prefill tokens. Both length ranges are inclusive.
    """
    check_positive(
        documents=documents,
        questions_per_document=questions_per_document,
        output_len=output_len,
    )
    check_range("doc_len_range", doc_len_range)
    check_range("question_len", question_len)
    check_choice("order", order, ("shuffled", "grouped"))
    check_vocab(vocab_size)

    rng = np.random.default_rng(seed)
    total = documents * questions_per_document
    doc_lens = rng.integers(doc_len_range[0], doc_len_range[1], size=documents, endpoint=True)
    docs = _distinct_sequences(rng, doc_lens, vocab_size)
    members = _arrange(rng, np.repeat(np.arange(documents), questions_per_document), order)
    q_lens = rng.integers(question_len[0], question_len[1], size=total, endpoint=True)
    questions = _distinct_sequences(rng, q_lens, vocab_size)
    parts = [
        (np.concatenate([docs[d], question]), output_len, d, docs[d].size)
        for d, question in zip(members, questions, strict=True)
    ]
    return _build("long-docs", parts, arrival_times(total, arrival, rng))


def multi_turn_chat(
    *,
    conversations: int,
    turns: int,
    system_prompt_len: int,
    user_turn_len: int,
    assistant_turn_len: int,
    output_len: int,
    think_s: float = 1.0,
    arrival: ArrivalSpec | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Workload:
    """Conversations whose every turn resends the whole history plus a new user message.

    All conversations start with one common system prompt; turn ``t`` of a conversation is
    its turn ``t-1`` prompt + an assistant reply (``assistant_turn_len`` random tokens) + a
    new user message, so ``shared_len`` is everything before the new user message and
    ``group`` is the conversation index. With ``arrival=None`` every request arrives at 0
    (turn-major order: all first turns, then all second turns, ...); otherwise ``arrival``
    sets the conversation start times and turn ``t`` arrives ``t * think_s`` later.
    """
    check_positive(
        conversations=conversations,
        turns=turns,
        system_prompt_len=system_prompt_len,
        user_turn_len=user_turn_len,
        assistant_turn_len=assistant_turn_len,
        output_len=output_len,
    )
    if not (math.isfinite(think_s) and think_s > 0):
        raise ValueError(f"think_s must be finite and > 0, got {think_s}")
    check_vocab(vocab_size)

    rng = np.random.default_rng(seed)
    system = random_tokens(rng, system_prompt_len, vocab_size)
    contexts = [system] * conversations
    parts = []
    for _ in range(turns):
        for c in range(conversations):
            prompt = np.concatenate([contexts[c], random_tokens(rng, user_turn_len, vocab_size)])
            parts.append((prompt, output_len, c, contexts[c].size))
            answer = random_tokens(rng, assistant_turn_len, vocab_size)
            contexts[c] = np.concatenate([prompt, answer])
    starts = arrival_times(conversations, arrival, rng)
    turn_offsets = np.arange(turns)[:, None] * (0.0 if arrival is None else think_s)
    return _build("chat", parts, (starts[None, :] + turn_offsets).ravel())


def _own_prefixes(rng: np.random.Generator, owners: np.ndarray,
                  parts: list[tuple[np.ndarray, int, int, int]], k: int, prefix_len: int,
                  vocab_size: int) -> list[tuple[np.ndarray, int, int, int]]:
    """``multi_tenant``'s odd tenants' prompts behind one of their own ``k`` prefixes."""
    odd = sorted({int(t) for t in owners if t % 2})
    prefixes = {t: [random_tokens(rng, prefix_len, vocab_size) for _ in range(k)] for t in odd}
    picks = rng.integers(k, size=len(owners))
    return [(np.concatenate([prefixes[t][g], own]), out, 1 + odd.index(t) * k + int(g),
             prefix_len) if t % 2 else (own, out, group, shared)
            for t, g, (own, out, group, shared) in zip(owners, picks, parts, strict=True)]


def no_sharing(
    *,
    requests: int,
    prompt_len: int,
    output_len: int,
    jitter: float = 0.0,
    arrival: ArrivalSpec | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Workload:
    """Control workload: independent random prompts, so prefix caching cannot help."""
    check_positive(requests=requests, prompt_len=prompt_len, output_len=output_len)
    check_jitter(jitter)
    check_vocab(vocab_size)

    rng = np.random.default_rng(seed)
    prompts = _distinct_sequences(rng, _jittered(rng, prompt_len, jitter, requests), vocab_size)
    outputs = _jittered(rng, output_len, jitter, requests)
    parts = [(prompt, out, -1, 0) for prompt, out in zip(prompts, outputs, strict=True)]
    return _build("no-sharing", parts, arrival_times(requests, arrival, rng))


def multi_tenant(
    *,
    tenants: int,
    requests_per_tenant: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    flood_factor: int = 4,
    long_output_factor: int = 8,
    short_prompt_len: int = 256,
    prefixes_per_tenant: int = 0,
    arrival: ArrivalSpec | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Workload:
    """Tenants of unequal habits, shuffled together: where prefix order alone gives one
    tenant everything.  Tenant ``t0`` floods: ``flood_factor * requests_per_tenant``
    requests sharing one ``prefix_len``-token prefix (group 0), each with its own suffix;
    the others send ``requests_per_tenant`` requests each, odd ones unshared prompts of
    ``prefix_len + suffix_len`` tokens, even ones short unshared prompts
    (``short_prompt_len``) with ``long_output_factor`` times the output.  With
    ``prefixes_per_tenant`` k > 0 an odd tenant's prompts are instead one of its own k
    ``prefix_len``-token prefixes (drawn at random per request, a group each) and a
    ``suffix_len``-token suffix: several long shared prefixes per tenant, as in DLPM's
    evaluation, where an order that interleaves tenants also interleaves prefixes."""
    check_positive(tenants=tenants, requests_per_tenant=requests_per_tenant,
                   prefix_len=prefix_len, suffix_len=suffix_len, output_len=output_len,
                   flood_factor=flood_factor, long_output_factor=long_output_factor,
                   short_prompt_len=short_prompt_len)
    if tenants < 2:
        raise ValueError(f"a multi-tenant workload needs 2 or more tenants, got {tenants}")
    if prefixes_per_tenant < 0:
        raise ValueError(f"prefixes_per_tenant must be non-negative, got {prefixes_per_tenant}")
    check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    flood = flood_factor * requests_per_tenant
    owners = np.repeat(np.arange(tenants), [flood] + [requests_per_tenant] * (tenants - 1))
    owners = rng.permutation(owners)
    prefix = random_tokens(rng, prefix_len, vocab_size)
    grouped = prefixes_per_tenant > 0
    lengths = [suffix_len if t == 0 or (t % 2 and grouped) else
               prefix_len + suffix_len if t % 2 else short_prompt_len for t in owners]
    unique = _distinct_sequences(rng, lengths, vocab_size)
    parts = [(np.concatenate([prefix, own]), output_len, 0, prefix_len) if t == 0 else
             (own, output_len * (1 if t % 2 else long_output_factor), -1, 0)
             for t, own in zip(owners, unique, strict=True)]
    if grouped:
        parts = _own_prefixes(rng, owners, parts, prefixes_per_tenant, prefix_len, vocab_size)
    return _build("multi-tenant", parts, arrival_times(len(parts), arrival, rng),
                  [f"t{t}" for t in owners])


LIGHT_USER_PREFIX = "user"
"""The tenant id of a light user of ``document_tenants``: this prefix and its number."""
Stream = list[tuple[float, str, tuple[np.ndarray, int, int, int]]]
"""(arrival, tenant, (prompt, output_len, group, shared_len)) entries of one generator."""


def document_tenants(
    *,
    doc_tenants: int = 2,
    documents_per_tenant: int,
    doc_len: int,
    question_len: tuple[int, int] = (16, 64),
    doc_output_len: int,
    doc_rate: float,
    chat_prompt_len: int,
    chat_output_len: int,
    chat_rate: float,
    duration_s: float,
    light_users: int = 0,
    light_requests: int = 3,
    light_prompt_len: int = 1024,
    light_output_len: int = 256,
    light_gap_s: float = 5.0,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Workload:
    """Tenants ``docs0``, ``docs1``, ... each ask questions (``question_len`` tokens, both
    ends inclusive) about one of their own ``documents_per_tenant`` private documents of
    ``doc_len`` tokens (drawn at random per request; a group each), Poisson at
    ``doc_rate`` req/s each; beside them tenant ``chat`` sends short unshared prompts
    (``chat_prompt_len``) with long outputs (``chat_output_len``), Poisson at the low
    ``chat_rate`` (0: no chat tenant), and ``light_users`` tenants ``user0``, ... each
    appear at a uniform time and send 1 to ``light_requests`` unshared prompts
    (``light_prompt_len``, ``light_output_len``) exponential ``light_gap_s`` apart: the
    light tenants fair share must protect from tenants flooding with document sets
    larger than the KV pool.  Each stream lasts about ``duration_s``."""
    check_positive(doc_tenants=doc_tenants, documents_per_tenant=documents_per_tenant,
                   doc_len=doc_len, doc_output_len=doc_output_len,
                   chat_prompt_len=chat_prompt_len, chat_output_len=chat_output_len,
                   light_requests=light_requests, light_prompt_len=light_prompt_len,
                   light_output_len=light_output_len)
    check_range("question_len", question_len)
    for name, value in (("doc_rate", doc_rate), ("duration_s", duration_s),
                        ("light_gap_s", light_gap_s)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be finite and > 0, got {value}")
    if not (math.isfinite(chat_rate) and chat_rate >= 0) or light_users < 0:
        raise ValueError(f"chat_rate and light_users must be >= 0, got {chat_rate}, "
                         f"{light_users}")
    check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    streams = _document_streams(rng, doc_tenants, documents_per_tenant, doc_len,
                                question_len, doc_output_len, doc_rate, duration_s,
                                vocab_size)
    if chat_rate > 0:
        n = max(1, round(chat_rate * duration_s))
        prompts = _distinct_sequences(rng, [chat_prompt_len] * n, vocab_size)
        times = arrival_times(n, ArrivalSpec("poisson", chat_rate), rng)
        streams += [(t, "chat", (prompt, chat_output_len, -1, 0))
                    for t, prompt in zip(times, prompts, strict=True)]
    streams += _light_user_streams(rng, light_users, light_requests, light_prompt_len,
                                   light_output_len, light_gap_s, duration_s, vocab_size)
    streams.sort(key=lambda entry: entry[0])
    return _build("document-tenants", [part for _, _, part in streams],
                  np.array([t for t, _, _ in streams]), [tenant for _, tenant, _ in streams])


def _document_streams(rng: np.random.Generator, tenants: int, documents: int, doc_len: int,
                      question_len: tuple[int, int], output_len: int, rate: float,
                      duration_s: float, vocab_size: int) -> Stream:
    """Each document tenant's questions about its own documents, Poisson at ``rate``."""
    docs = _distinct_sequences(rng, [doc_len] * (tenants * documents), vocab_size)
    streams: Stream = []
    for tenant in range(tenants):
        n = max(1, round(rate * duration_s))
        picks = tenant * documents + rng.integers(documents, size=n)
        questions = _distinct_sequences(
            rng, rng.integers(question_len[0], question_len[1], size=n, endpoint=True),
            vocab_size)
        times = arrival_times(n, ArrivalSpec("poisson", rate), rng)
        streams += [(t, f"docs{tenant}", (np.concatenate([docs[d], q]), output_len,
                                          int(d), doc_len))
                    for t, d, q in zip(times, picks, questions, strict=True)]
    return streams


def _light_user_streams(rng: np.random.Generator, users: int, most: int, prompt_len: int,
                        output_len: int, gap_s: float, duration_s: float,
                        vocab_size: int) -> Stream:
    """``users`` tenants, each from a uniform moment sending 1 to ``most`` unshared
    prompts, exponential ``gap_s`` apart."""
    streams: Stream = []
    for user in range(users):
        n = int(rng.integers(1, most, endpoint=True))
        times = rng.uniform(0, duration_s) + np.cumsum(
            np.concatenate([[0.0], rng.exponential(gap_s, size=n - 1)]))
        prompts = _distinct_sequences(rng, [prompt_len] * n, vocab_size)
        streams += [(float(t), f"{LIGHT_USER_PREFIX}{user}", (prompt, output_len, -1, 0))
                    for t, prompt in zip(times, prompts, strict=True)]
    return streams
