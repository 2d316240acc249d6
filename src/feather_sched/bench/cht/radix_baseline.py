"""A token-level radix tree and SGLang-style longest-prefix-match ordering (a baseline).

This is how prefix-aware schedulers before Feather find shared prefixes: every scheduling
pass walks a radix tree of cached tokens once per waiting request, comparing token by
token, then sorts the queue by matched length.  SGLang's ``lpm`` policy also keeps a
second tree of the waiting requests seen so far in the pass and pushes back a request
whose prefix (of at most 32 cached tokens) another waiting request already claims.
Written here, in the same pure Python as SGLang's ``RadixCache`` with page size 1, so
``feather cht-bench`` can compare structures without SGLang installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

IN_BATCH_CHECK_TOKENS = 32
"""SGLang's in-batch prefix threshold (IN_BATCH_PREFIX_CACHING_*_THRESHOLD)."""


@dataclass
class _Node:
    edge: list[int] = field(default_factory=list)
    children: dict[int, _Node] = field(default_factory=dict)


class TokenRadixTree:
    """Token sequences stored with shared prefixes collapsed into edges."""

    def __init__(self) -> None:
        self.root = _Node()

    def insert(self, tokens: Sequence[int]) -> None:
        node, i = self.root, 0
        tokens = list(tokens)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = _Node(edge=tokens[i:])
                return
            common = _common_length(child.edge, tokens, i)
            if common < len(child.edge):
                self._split(node, child, common)
                child = node.children[tokens[i]]
            node, i = child, i + common

    def match_prefix(self, tokens: Sequence[int]) -> int:
        """Length of the longest stored prefix of ``tokens``."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            common = _common_length(child.edge, tokens, i)
            i += common
            if common < len(child.edge):
                break
            node = child
        return i

    @staticmethod
    def _split(parent: _Node, child: _Node, at: int) -> None:
        head = _Node(edge=child.edge[:at])
        child.edge = child.edge[at:]
        head.children[child.edge[0]] = child
        parent.children[head.edge[0]] = head


def _common_length(edge: list[int], tokens: Sequence[int], start: int) -> int:
    """Tokens shared by ``edge`` and ``tokens[start:]``, compared one at a time."""
    n = min(len(edge), len(tokens) - start)
    for j in range(n):
        if edge[j] != tokens[start + j]:
            return j
    return n


def lpm_order(cache: TokenRadixTree, waiting: Sequence[Sequence[int]]) -> list[int]:
    """Indices of ``waiting`` in SGLang LPM order: longest cached prefix first.

    Requests with a short cached prefix that another waiting request already shares
    (``IN_BATCH_CHECK_TOKENS`` tokens or more) go last, as SGLang's in-batch prefix
    caching does, so that only one of them is prefilled first.
    """
    in_batch = TokenRadixTree()
    keys = []
    for index, tokens in enumerate(waiting):
        matched = cache.match_prefix(tokens)
        pushed_back = False
        if matched <= IN_BATCH_CHECK_TOKENS:
            if in_batch.match_prefix(tokens) >= IN_BATCH_CHECK_TOKENS:
                pushed_back = True
            else:
                in_batch.insert(tokens)
        keys.append((pushed_back, -matched, index))
    return [index for *_, index in sorted(keys)]
