"""The CPU segment-attention kernel: built once per machine with the host's compiler.

``cpu_prefix_kernel.cpp`` attends "segments" (a prefix group's decode queries over the
group's shared KV blocks, or one request's suffix) straight from vLLM's CPU KV cache, or
from a token-major KV pool through a list of token slots (SGLang's), and returns fp32
partials with their log-sum-exp. It is compiled on first use with
``c++ -O3 -march=native -fopenmp`` (vLLM's CPU build already needs a C++ compiler at run
time, for torch.compile) into a per-user cache keyed by the source, the flags, the
compiler and this CPU's feature flags, so a machine with another processor builds its
own; it is written under a temporary name and renamed into place, so concurrent engines
never load half a file. With AVX-512 it works in registers (``vectorized``), over vLLM's
"amx" cache or SGLang's pool in AMX tiles where the CPU has them (``tiles``: a group's
rows times its prefix as one matrix product); elsewhere it is a portable loop. Building
fails with ``KernelUnavailable`` (the reason in its message) where there is no compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

from feather_sched.attention.groups import MIN_SHARED_TOKENS, StepPlan

SOURCE = Path(__file__).with_name("cpu_prefix_kernel.cpp")
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
CACHE_ENV = "FEATHER_KERNEL_CACHE"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The cache dtypes the kernel reads (fp8 caches are not read)."""
LAYOUT_CODES = {"vec": 0, "amx": 1, "nhd": 2}
"""The KV layouts it reads: vLLM's, by its name for them (``CPUAttentionBackendImpl.isa``),
"vec" for any of those dtypes and "amx" (vLLM's choice for bf16 where the CPU has AMX) for
bf16; and "nhd", separate K and V buffers ``[slots, kv_heads, head_dim]`` read through
each segment's token slots (SGLang's ``MHATokenToKVPool``), for any of those dtypes."""
MIN_SHARED_TOKENS_BY_LAYOUT = {"vec": MIN_SHARED_TOKENS, "amx": 8192, "nhd": MIN_SHARED_TOKENS}
"""Shortest shared prefix worth a group, per layout, where no check measured one (``on``).
Over an "amx" cache vLLM's kernel multiplies in AMX tiles, several times this kernel's
AVX-512 rate, and ``on`` keeps this kernel in registers (its tiles act only once a check
measured them), so reading a prefix once pays only from long prefixes (the crossover, as
measured: docs/results.md#shared-prefix-attention); ``auto`` measures its own."""
HEAD_SIZES = "multiples of 16"
"""The head sizes the kernel reads (``head_size_fits``), as a log line names them."""
BUILD_TIMEOUT_S = 300

_I64, _I32, _VOID = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded on this machine (the message says why)."""


@cache
def load() -> ctypes.CDLL:
    """The kernel built for this CPU (``-march=native``; ~3 s the first time)."""
    return build("native")


def build(march: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernel built for ``-march=march`` with the preprocessor ``defines`` (tests build
    ``FEATHER_EMULATE_TILES``), from the on-disk cache when it is there."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise KernelUnavailable("no C++ compiler (c++ or g++) on PATH")
    flags = (*FLAGS, f"-march={march}", *(f"-D{name}" for name in defines))
    library = _cache_dir() / f"feather_prefix_{_build_key(compiler, flags)}.so"
    if not library.exists():
        _build(compiler, flags, library)
    lib = ctypes.CDLL(str(library))
    lib.feather_kernel_vectorized.restype = _I32
    lib.feather_kernel_tiles.restype = _I32
    lib.feather_segment_attention.restype = _I32
    lib.feather_merge_halves.restype = None
    lib.feather_merge_halves.argtypes = [_I64, _I32, _I32, _VOID, _VOID, _I32]
    lib.feather_segment_attention.argtypes = [
        _I32, _I32, _VOID, _VOID, _I64, _VOID, _I64, _I32, _I32, _I32, _I32, ctypes.c_float, _I32,
        _VOID, _VOID, _VOID, _VOID, _VOID, _VOID, _VOID, _I32, _I32]
    return lib


def head_size_fits(head_dim: int) -> bool:
    """Whether the kernel reads heads of ``head_dim`` (``HEAD_SIZES``: its AVX-512 loop
    takes 16 lanes at a time)."""
    return head_dim > 0 and head_dim % 16 == 0


def vectorized() -> bool:
    """Whether this CPU's kernel works in AVX-512 registers (faster than vLLM's kernel);
    False: the portable loop (exact, but no faster)."""
    return bool(load().feather_kernel_vectorized())


TILE_KINDS = {0: None, 1: "amx", 2: "emulated"}


def tiles() -> str | None:
    """How bf16 heads of a multiple of 32 multiply over an "amx" cache or an "nhd" pool:
    "amx" in AMX tiles (the build has them and Linux granted this process the tile
    state), "emulated" (a test build), or None: in AVX-512 registers."""
    return TILE_KINDS[load().feather_kernel_tiles()]


def tiles_proven(verdict: object | None) -> bool:
    """Whether an engine multiplies in this build's tiles: only AMX's, and only where the
    self-check, run in a process of its own (``tiles_need_isolation``), measured the path
    exact and faster (``verdict``). The AVX-512 path, tested on every CPU with AVX-512,
    serves otherwise."""
    return verdict is not None and tiles() == "amx"


def tiles_need_isolation() -> bool:
    """Whether the self-check must run away from the engine: the AMX tile path is not
    exercised where the project is tested (its logic is, through the emulated build), so
    its first run on a machine happens in a child process a fault cannot reach the engine
    from (``isolation.run_isolated``)."""
    return tiles() == "amx"


def path(use_tiles: bool) -> str:
    """How an engine's calls multiply, for its log line: "amx tiles" (or "emulated
    tiles"), "AVX-512 registers" or "a portable loop"."""
    kind = tiles() if use_tiles else None
    if kind:
        return f"{kind} tiles"
    return "AVX-512 registers" if vectorized() else "a portable loop"


def isa() -> str:
    """The instructions this CPU's kernel multiplies with, per layout, for records:
    e.g. "amx tiles (bf16 amx/nhd); avx512-bf16" or "portable"."""
    if not vectorized():
        return "portable"
    dot = "avx512-bf16" if "avx512_bf16" in _cpu_flags() else "avx512"
    kind = tiles()
    return f"{kind} tiles (bf16 amx/nhd); {dot}" if kind else dot


KVCache = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""One layer's KV as the kernel reads it: vLLM's CPU cache tensor ("vec", "amx"), or the
(K, V) buffers of a token-major pool ("nhd")."""


def segment_attention(kv_cache: KVCache, query: torch.Tensor, scale: float,
                      token_offsets: torch.Tensor, tokens: torch.Tensor,
                      block_offsets: torch.Tensor, blocks: torch.Tensor,
                      lengths: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      layout: str = "vec", use_tiles: bool = False) -> None:
    """Attend each segment over its KV blocks; write fp32 partials and natural-log LSE.

    ``kv_cache``: one layer's vLLM CPU cache ``[num_blocks, kv_heads, block_size,
    2 * head_dim]`` in ``layout`` (``LAYOUT_CODES``), or for "nhd" its K and V buffers
    ``[slots, kv_heads, head_dim]`` (one stride between slots for both); ``query``:
    ``[num_tokens, q_heads, head_dim]`` of the cache's dtype, rows contiguous. Segment
    ``s``: query tokens ``tokens[token_offsets[s]:token_offsets[s+1]]`` (int64) over blocks
    ``blocks[block_offsets[s]:block_offsets[s+1]]`` (int32; "nhd": one slot per token),
    its first ``lengths[s]`` tokens (int32); its rows of ``out`` (``[len(tokens), q_heads,
    head_dim]`` fp32) and ``lse`` (``[len(tokens), q_heads]``) start at
    ``token_offsets[s]``; no tokens give LSE -inf and a zero output. ``use_tiles``: a bf16
    "amx" cache or "nhd" pool multiplies in tiles where ``tiles()`` has them (engines ask
    once a check proved them: ``tiles_proven``). Cost: one pass over each segment's KV per
    KV head, parallel over (segment, KV head), long segments split over idle threads.
    """
    if layout == "nhd":
        keys, values = _token_major(kv_cache)
        _, kv_heads, head_dim = keys.shape
        block_size, token_stride = 1, keys.stride(0)
    else:
        keys = values = _cache_tensor(kv_cache, layout)
        _, kv_heads, block_size, double_dim = keys.shape
        head_dim, token_stride = double_dim // 2, 0
    q_heads = query.shape[1]
    _check(keys, query, out, lse, tokens, token_offsets, block_offsets, blocks, lengths,
           head_dim, layout)
    status = load().feather_segment_attention(
        DTYPE_CODES[keys.dtype], LAYOUT_CODES[layout], keys.data_ptr(), values.data_ptr(),
        token_stride, query.data_ptr(), query.stride(0), kv_heads, block_size, head_dim,
        q_heads // kv_heads,
        scale, len(lengths),
        token_offsets.data_ptr(), tokens.data_ptr(), block_offsets.data_ptr(),
        blocks.data_ptr(), lengths.data_ptr(), out.data_ptr(), lse.data_ptr(),
        torch.get_num_threads(), int(use_tiles))
    if status != 0:
        raise ValueError(f"segment attention failed with status {status}")


def attend_groups(plan: StepPlan, query: torch.Tensor, kv_cache: KVCache, scale: float,
                  output: torch.Tensor, layout: str = "vec", use_tiles: bool = False) -> None:
    """Overwrite the grouped rows of ``output`` (``[tokens, q_heads, head_dim]``) with their
    attention: each group's prefix once for all its queries, each row's suffix, merged.

    One kernel call for all of the plan's segments, one fp32 merge in place
    (``feather_merge_halves``); the other rows of ``output`` are left as the engine's
    kernel wrote them.
    """
    segments = plan.segments
    heads, head_dim = query.shape[1:]
    partials = torch.empty(segments.rows, heads, head_dim)
    lse = torch.empty(segments.rows, heads)
    segment_attention(kv_cache, query, scale, segments.token_offsets, segments.tokens,
                      segments.block_offsets, segments.blocks, segments.lengths, partials, lse,
                      layout, use_tiles)
    rows = len(plan.tokens)
    load().feather_merge_halves(rows, heads, head_dim, partials.data_ptr(), lse.data_ptr(),
                                torch.get_num_threads())
    output[plan.tokens] = partials[:rows].to(output.dtype)


def _token_major(kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The "nhd" layout's (K, V), checked: same dtype and shape, each slot's heads packed,
    one stride between slots."""
    if isinstance(kv_cache, torch.Tensor) or len(kv_cache) != 2:
        raise TypeError("the nhd layout reads a (keys, values) pair of buffers")
    keys, values = kv_cache
    if keys.dtype != values.dtype or keys.shape != values.shape or keys.dim() != 3:
        raise ValueError(f"keys {keys.dtype} {tuple(keys.shape)} / values {values.dtype} "
                         f"{tuple(values.shape)}: one shape, [slots, kv_heads, head_dim]")
    packed = (keys.shape[2], 1)
    if keys.stride()[1:] != packed or values.stride()[1:] != packed or \
            keys.stride(0) != values.stride(0):
        raise ValueError("each slot's heads packed, and one stride between slots for K and V")
    return keys, values


def _cache_tensor(kv_cache: KVCache, layout: str) -> torch.Tensor:
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"the {layout!r} layout reads one cache tensor")
    if not kv_cache.is_contiguous():
        raise ValueError("the cache must be contiguous")
    return kv_cache


def _check(kv_cache: torch.Tensor, query: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
           tokens: torch.Tensor, token_offsets: torch.Tensor, block_offsets: torch.Tensor,
           blocks: torch.Tensor, lengths: torch.Tensor, head_dim: int, layout: str) -> None:
    """The layout the kernel assumes; a violation is a bug in the caller, so it raises."""
    if kv_cache.dtype not in DTYPE_CODES or query.dtype != kv_cache.dtype:
        raise TypeError(f"cache {kv_cache.dtype} / query {query.dtype}: the kernel reads "
                        "fp32, bf16 or fp16 caches and a query of the same dtype")
    if layout not in LAYOUT_CODES:
        raise ValueError(f"KV layout {layout!r}: the kernel reads {sorted(LAYOUT_CODES)}")
    if layout == "amx" and (kv_cache.dtype != torch.bfloat16 or kv_cache.shape[2] % 16):
        raise TypeError(f"the amx layout holds bf16 in blocks of a multiple of 16 tokens, "
                        f"not {kv_cache.dtype} in blocks of {kv_cache.shape[2]}")
    if query.stride(1) != head_dim or query.stride(2) != 1:
        raise ValueError("each query token's heads must be packed")
    if not head_size_fits(head_dim) or query.shape[2] != head_dim or \
            query.shape[1] % kv_cache.shape[1]:
        raise ValueError(f"head_dim {head_dim} ({HEAD_SIZES}) and query {query.shape}")
    expected = ((tokens, torch.int64), (token_offsets, torch.int64),
                (block_offsets, torch.int64), (blocks, torch.int32), (lengths, torch.int32),
                (out, torch.float32), (lse, torch.float32))
    for tensor, dtype in expected:
        if tensor.dtype != dtype or not tensor.is_contiguous():
            raise TypeError(f"expected a contiguous {dtype} tensor, got {tensor.dtype}")
    if out.shape != (len(tokens), *query.shape[1:]) or lse.shape != out.shape[:2]:
        raise ValueError(f"out {tuple(out.shape)} / lse {tuple(lse.shape)} for "
                         f"{len(tokens)} rows of {tuple(query.shape[1:])}")
    if len(token_offsets) != len(lengths) + 1 or len(block_offsets) != len(lengths) + 1:
        raise ValueError("token_offsets and block_offsets need one entry per segment, plus one")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build_key(compiler: str, flags: tuple[str, ...]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_text(), " ".join(flags), version, " ".join(sorted(_cpu_flags()))):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "feather_sched" / "kernels"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _build(compiler: str, flags: tuple[str, ...], library: Path) -> None:
    """Compile to a temporary name, then rename into place (atomic for readers)."""
    temporary = library.with_name(f".{library.name}.{os.getpid()}.tmp")
    try:
        result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(temporary)],
                                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(temporary, library)
    except subprocess.TimeoutExpired:
        raise KernelUnavailable(f"{compiler} took over {BUILD_TIMEOUT_S} s") from None
    finally:
        temporary.unlink(missing_ok=True)
