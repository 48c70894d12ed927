"""Numba CPU kernels' shared pieces: the JIT decorator and its disk cache, the ``mix32`` hash, bit casts,
LLVM intrinsics (wide vectors, a 16-lane gather, the fp16 cast, 64-bit comparison masks, selects and
compressed stores, unaligned 64-bit loads and stores) and a fast finiteness check.

Element-wise compressors run a numba kernel on CPU tensors (one pass, fused randomness and bit
packing) and a torch implementation elsewhere; tests check that both give the same bits. Set
``GRADPRESS_NUMBA=0`` (or use :func:`numba_disabled`) to force the torch path on the CPU
(:mod:`gradpress.kernels.dispatch`, which decides without loading numba).

Compiled kernels are kept on disk (:class:`KernelCache`): under ``$GRADPRESS_CACHE/numba`` when that
variable is set (else under numba's ``NUMBA_CACHE_DIR`` when that one is), else beside the package's
modules (``__pycache__``) where that is writable, else in the user's cache
(``$XDG_CACHE_HOME/gradpress/numba``, by default ``~/.cache/gradpress/numba``). A kernel compiled beside
the modules before (by ``gradpress compile`` when an image was built, say) is read from there in any case.
Installs of one version at different places share the kernels of a shared folder (``GRADPRESS_CACHE``, the
user's cache): a virtualenv finds those that a checkout or another virtualenv compiled from the same
sources.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.core.caching import CompileResultCacheImpl, FunctionCache, IndexDataCacheFile, _CacheLocator
from numba.extending import intrinsic

from gradpress._version import __version__
from gradpress.kernels import simd as V
from gradpress.kernels.dispatch import as_numpy, numba_disabled, use_numba  # noqa: F401 (re-export)

PACKAGE = Path(__file__).resolve().parents[1]  # the gradpress folder


# -- what a kernel's cached machine code depends on -----------------------------------------------------
@functools.cache
def _imported(path: Path, package: Path) -> tuple[Path, ...]:
    """The source files of ``package`` (the gradpress folder) that the module at ``path`` imports, by any
    import statement (also in a function: kept on the safe side), with ``gradpress.`` names resolved as
    the import system resolves them (``from gradpress.a import b``: the module ``a.b`` if there is one,
    else ``a``)."""
    def source(name: str) -> Path | None:
        parts = name.split(".")
        if parts[0] != package.name:
            return None
        base = package.joinpath(*parts[1:])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the module's own package
                if not path.is_relative_to(package.parent):
                    continue  # (a module outside gradpress: not one of gradpress's)
                anchor = path.parent.relative_to(package.parent).parts
                anchor = anchor[:len(anchor) - (node.level - 1)]
                module = ".".join([*anchor, module] if module else anchor)
            names = [f"{module}.{alias.name}" if source(f"{module}.{alias.name}") else module
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and source(name) is None:  # gradpress.a.b.c of a module gradpress.a.b: its file
                name = name.rpartition(".")[0]
            if name and (file := source(name)) is not None:
                found.add(file)
    found.discard(path)
    return tuple(sorted(found))


def dependencies(path: Path, package: Path = PACKAGE) -> tuple[Path, ...]:
    """The module at ``path`` and every module of ``package`` it imports, directly or not: all a kernel
    defined there can inline or read (helpers, intrinsics, module constants frozen at compile time)."""
    seen, stack = {path.resolve()}, [path.resolve()]
    while stack:
        for file in _imported(stack.pop(), package):
            if file not in seen:
                seen.add(file)
                stack.append(file)
    return tuple(sorted(seen))


@functools.cache
def sources_digest(path: Path, package: Path = PACKAGE) -> str:
    """SHA-256 of the sources a kernel defined in the module at ``path`` depends on
    (:func:`dependencies`: their paths within ``package`` and their contents).

    A numba kernel's on-disk cache is keyed on the file that defines it, but the machine code it holds
    also contains what the kernel inlined from other modules: the intrinsics here and in ``simd``,
    helpers of ``compressor`` or ``bits``, module constants frozen at compile time. With numba's key
    alone, a change to one of those left the kernels of every other module running their old code
    (found when a kernel cached with non-temporal stores, which need 64-byte alignment, outlived their
    removal from an intrinsic and crashed on an unaligned output). :class:`KernelCache` adds this digest
    to the key, so that a change to any module a kernel can reach compiles it again, and a change
    elsewhere (the testbed, the command line, a front end) does not."""
    digest = hashlib.sha256()
    for file in dependencies(path, package):
        name = file.relative_to(package) if file.is_relative_to(package) else file  # (a module of the user's)
        digest.update(str(name).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


# -- where compiled kernels are kept -----------------------------------------------------------------------
def chosen_cache() -> Path | None:
    """The folder set for the kernels, if one is: ``$GRADPRESS_CACHE/numba`` (gradpress's cache folder,
    that of THC's tables too), else numba's ``NUMBA_CACHE_DIR``; None if neither is set (or empty)."""
    root = os.environ.get("GRADPRESS_CACHE")
    if root:
        return Path(root).expanduser() / "numba"
    return Path(config.CACHE_DIR).expanduser() if config.CACHE_DIR else None


def user_cache() -> Path:
    """The user's folder for kernels that cannot go beside their module: ``$XDG_CACHE_HOME/gradpress/numba``
    (by default ``~/.cache/gradpress/numba``)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "gradpress" / "numba"


@functools.cache
def _writable(folder: str) -> bool:
    """Whether kernels can be written to ``folder`` (made if need be; numba's test: a temporary file)."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


def cache_folders(py_file: str) -> list[str]:
    """The folders a kernel of module ``py_file`` is looked up in, in order: the one set
    (:func:`chosen_cache`) and then beside the module (``__pycache__``: a kernel compiled there before);
    with none set, beside the module and then the user's folder (:func:`user_cache`). A new kernel is
    written to the first of them that is writable; the shared ones hold a subfolder per source folder
    (:func:`_subfolder`)."""
    subpath = _subfolder(py_file)
    beside = os.path.join(os.path.dirname(py_file), "__pycache__")
    chosen = chosen_cache()
    if chosen is not None:
        return [str(chosen / subpath), beside]
    return [beside, str(user_cache() / subpath)]


def _subfolder(py_file: str) -> str:
    """The subfolder of a shared cache folder that holds the kernels of module ``py_file``: its folder
    within gradpress, under the version (``gradpress-0.2.0/compressors``), so that every install of a
    version — a checkout, a virtualenv, a container image — finds the kernels another one compiled (the
    stamp, :func:`sources_digest`, still tells different sources apart: a kernel of other sources is
    compiled again, never used); numba's own (the folder's name and a hash of its path) for a module
    outside the package."""
    folder = Path(py_file).resolve().parent
    if folder.is_relative_to(PACKAGE):
        return str(Path(f"gradpress-{__version__}") / folder.relative_to(PACKAGE))
    return _CacheLocator.get_suitable_cache_subpath(py_file)


def describe_cache() -> str:
    """Where new kernels are written (:func:`cache_folders`), in words."""
    chosen = chosen_cache()
    for folder in cache_folders(str(PACKAGE / "kernels" / "jit.py")):
        if _writable(folder):
            if chosen is not None and folder.startswith(str(chosen)):
                return str(chosen)
            if folder.endswith("__pycache__"):
                return f"{PACKAGE}/**/__pycache__ (beside the modules)"
            return str(user_cache())
    return "nowhere: no cache folder is writable (kernels are compiled in every process)"


class _Locator(_CacheLocator):
    """One of a kernel's cache folders (see :func:`cache_folders`), stamped with the sources it depends on."""

    def __init__(self, py_func: Callable[..., Any], py_file: str, folder: str) -> None:
        self._py_file, self._folder = py_file, folder
        self._lineno = py_func.__code__.co_firstlineno

    def get_cache_path(self) -> str:
        return self._folder

    def ensure_cache_path(self) -> None:
        if not _writable(self._folder):
            raise OSError(f"{self._folder} is not writable")

    def get_source_stamp(self) -> str:
        return sources_digest(Path(self._py_file))

    def get_disambiguator(self) -> str:
        return str(self._lineno)  # (numba's: functions of one name told apart by their line)


class _KernelCacheImpl(CompileResultCacheImpl):
    """numba's cache of compiled results (what its ``CacheImpl`` sets up), at the first writable place of
    :func:`cache_folders`, or at the first place if none is writable (then only read)."""

    def __init__(self, py_func: Callable[..., Any]) -> None:  # (not numba's: it would pick its own locators)
        py_file = inspect.getfile(py_func)
        folders = cache_folders(os.path.abspath(py_file))
        chosen = next((folder for folder in folders if _writable(folder)), None)  # (made only if need be)
        self.writable = chosen is not None
        self.readable = [_Locator(py_func, py_file, folder) for folder in folders]
        self._locator = _Locator(py_func, py_file, folders[0] if chosen is None else chosen)
        self._lineno = py_func.__code__.co_firstlineno
        qualname = getattr(py_func, "__qualname__", py_func.__name__)
        module = os.path.splitext(os.path.basename(py_file))[0]
        self._filename_base = self.get_filename_base(f"{module}.{qualname}", getattr(sys, "abiflags", ""))


class KernelCache(FunctionCache):
    """A kernel's on-disk cache, valid only for the sources it was compiled from
    (:func:`sources_digest`), read from every place of :func:`cache_folders` and written to the first
    writable one (nowhere if none is: the kernel is then compiled in every process)."""

    _impl_class = _KernelCacheImpl

    def __init__(self, py_func: Callable[..., Any]) -> None:
        super().__init__(py_func)
        impl = self._impl
        self._others = [IndexDataCacheFile(locator.get_cache_path(), impl.filename_base,
                                           locator.get_source_stamp())
                        for locator in impl.readable if locator.get_cache_path() != self._cache_path]

    def _index_key(self, sig: Any, codegen: Any) -> Any:
        """numba's key of a compiled specialization, with a kernel's closure read by name.

        numba keys a closure (a kernel a factory made, e.g. one per element operation it inlines) by the
        pickled contents of its cells; a kernel among them pickles with a process-random id, so the key
        never matched again: every process compiled such kernels anew and added one more entry to their
        index on disk. A kernel, function or module in a cell is named instead (its module and
        qualified name; their sources are part of the stamp, :func:`sources_digest`)."""
        closure = self._py_func.__closure__
        if closure is None:
            return super()._index_key(sig, codegen)
        named = tuple(_by_name(cell.cell_contents) for cell in closure)
        signature, magic, (code, _) = super()._index_key(sig, codegen)
        return signature, magic, (code, hashlib.sha256(pickle.dumps(named)).hexdigest())

    def _load_overload(self, sig: Any, target_context: Any) -> Any:
        if not self._enabled:
            return None
        key = self._index_key(sig, target_context.codegen())
        for place in (self._cache_file, *self._others):
            try:
                found = place.load(key)
            except OSError:  # (e.g. a file where the folder would be)
                continue
            if found is not None:
                return self._impl.rebuild(target_context, found)
        return None

    def _save_overload(self, sig: Any, data: Any) -> None:
        if self._impl.writable:
            super()._save_overload(sig, data)


def _by_name(value: Any) -> Any:
    """A closure cell's contents as :meth:`KernelCache._index_key` keys them: a kernel (numba
    dispatcher) or function by its module and qualified name, a module by its name, anything else as
    it is."""
    function = getattr(value, "py_func", value)
    if inspect.isfunction(function):
        return (function.__module__, function.__qualname__)
    if inspect.ismodule(function):
        return (function.__name__,)
    return value


#: every dispatcher :func:`kernel` made, for :func:`compile_counts`
KERNELS: list[Any] = []


def kernel(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(nogil=True, **options)`` with the on-disk cache of :class:`KernelCache` (what
    ``cache=True`` gives, kept only while no source the kernel depends on changed): every numba function
    of gradpress is compiled through this."""

    def decorate(function: Callable[..., Any]) -> Any:
        dispatcher = njit(**{"nogil": True, **options})(function)
        dispatcher._cache = KernelCache(dispatcher.py_func)  # what Dispatcher.enable_caching sets
        KERNELS.append(dispatcher)
        return dispatcher

    return decorate


jit = kernel()


def compile_counts() -> tuple[int, int]:
    """(specializations compiled, specializations loaded from the disk cache) by the kernels of
    :data:`KERNELS` in this process so far."""
    compiled = loaded = 0
    for dispatcher in KERNELS:
        stats = dispatcher.stats
        compiled += sum(stats.cache_misses.values())
        loaded += sum(stats.cache_hits.values())
    return compiled, loaded


@intrinsic
def mul32(typingctx, a, b):  # pragma: no cover - compiled
    """uint32 × uint32 mod 2^32. Numba types a uint32 product as a 64-bit integer and keeps the high
    bits; this multiplies in 32-bit lanes (which also vectorizes)."""
    signature = types.uint32(types.uint32, types.uint32)

    def codegen(context, builder, sig, args):
        return builder.mul(args[0], args[1])

    return signature, codegen


def _bitcast(result, argument, llvm_type):  # noqa: ANN001, ANN202
    """An intrinsic reinterpreting an ``argument``-typed value's bits as ``result`` (no conversion)."""

    @intrinsic
    def cast(typingctx, value):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], llvm_type)

        return result(argument), codegen

    return cast


#: bit casts between floats and their IEEE 754 patterns, for kernels that work on exponents and mantissas
f32_from_bits = _bitcast(types.float32, types.uint32, ir.FloatType())
bits_of_f32 = _bitcast(types.uint32, types.float32, ir.IntType(32))
f64_from_bits = _bitcast(types.float64, types.uint64, ir.DoubleType())
bits_of_f64 = _bitcast(types.uint64, types.float64, ir.IntType(64))


@intrinsic
def f16_bits_of_f32(typingctx, value):  # pragma: no cover - compiled
    """The IEEE half-precision bit pattern (uint16) of float32 ``value``, rounded to nearest even as
    ``torch.Tensor.to(torch.float16)`` rounds (subnormals, overflow to ±Inf, NaN to a NaN): LLVM's
    ``fptrunc``, one ``vcvtps2ph`` per 16 values on CPUs with F16C/AVX-512, exact software elsewhere."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def f32_of_f16_bits(typingctx, value):  # pragma: no cover - compiled
    """The float32 value of IEEE half-precision bit pattern ``value`` (uint16), exact, as
    ``Tensor.float()`` of a float16 tensor: LLVM's ``fpext`` (``vcvtph2ps``)."""
    if value != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@jit
def _top_exponent(bits, mask):  # pragma: no cover - compiled
    wide_vectors()
    top = bits.dtype.type(0)
    for i in range(bits.size):
        top = max(top, bits[np.uint64(i)] & mask)
    return top


_EXPONENT = {torch.float32: (np.uint32, 0x7F800000), torch.float16: (np.uint16, 0x7C00),
             torch.bfloat16: (np.uint16, 0x7F80)}


def finite(t: torch.Tensor) -> bool:
    """Whether a contiguous CPU float32/fp16/bf16 tensor holds no NaN or Inf: one vectorized pass for
    the largest exponent field (all ones: NaN or Inf), half the time of counting them."""
    dtype, mask = _EXPONENT[t.dtype]
    bits = as_numpy(t).reshape(-1).view(dtype)
    return int(_top_exponent(bits, dtype(mask))) != mask


GOLDEN = np.uint32(0x9E3779B1)  # mix32's multiplier of the index


@kernel(inline="always")
def mix32_from(h, seed):  # pragma: no cover - compiled
    """``mix32(i, seed)``, bit for bit, given h = i·GOLDEN mod 2^32.

    A loop over consecutive i advances h by adding GOLDEN: one vectorized multiply (of three) fewer per
    hash, which is the largest cost of natural compression's and dithering's kernels (measured 0.39 →
    0.25 ms per 2^21 hashes). The numba-vs-torch tests check the bits against
    :func:`gradpress.core.rng.mix32_torch`.
    """
    u = np.uint32
    h = u(h ^ u(seed))
    h = u(h ^ u(h >> u(16)))
    h = mul32(h, u(0x85EBCA6B))
    h = u(h ^ u(h >> u(13)))
    h = mul32(h, u(0xC2B2AE35))
    return u(h ^ u(h >> u(16)))


@kernel(inline="always")
def mix32(i, seed):  # pragma: no cover - compiled
    """MurmurHash3 fmix32 of ``i * GOLDEN ^ seed``, bit for bit :func:`gradpress.core.rng.mix32_torch`."""
    return mix32_from(mul32(np.uint32(i), GOLDEN), seed)


@intrinsic
def wide_vectors(typingctx):  # pragma: no cover - compiled
    """Let LLVM vectorize the calling kernel at the widest width the CPU has (AVX-512: 16 float32 lanes).

    LLVM's x86 tuning prefers 256-bit vectors on AVX-512 CPUs; for the integer-heavy loops of natural
    compression and dithering (hashing, quantizing, packing) 512 bits measured 1.3-1.7× faster. This
    sets the function attribute clang's ``-mprefer-vector-width=512`` sets, on the calling kernel only
    (no process-wide setting); it changes no result, and nothing on CPUs without wider vectors.
    llvmlite's attribute set accepts flag attributes only, so this key-value one is added as its IR text.
    """
    sig = types.void()

    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return sig, codegen


@kernel(inline="always")
def uniform24(i, seed):  # pragma: no cover - compiled
    """Uniform float32 in [0, 1) with 24 random bits, equal to :func:`gradpress.core.rng.uniform24_torch`."""
    return np.float32(mix32(i, seed) >> np.uint32(8)) * np.float32(2.0**-24)


_GATHER_LANES = 16


@intrinsic
def gather16(typingctx, table, indices, out, start):  # pragma: no cover - compiled
    """``out[start + k] = table[indices[start + k]]`` for k < 16, as one vector gather.

    ``table`` and ``out`` hold 4-byte elements of the same type (uint32, int32 or float32), ``indices``
    unsigned integers; nothing is bounds-checked. Numba does not vectorize a loop of table lookups;
    LLVM's ``llvm.masked.gather`` is one ``vpgatherdd``/``vgatherdps`` on AVX-512 and AVX2 CPUs and is
    lowered lane by lane elsewhere (the same results everywhere)."""
    arrays = all(isinstance(a, types.Array) for a in (table, indices, out))
    if not (arrays and table.dtype == out.dtype and table.dtype in (types.uint32, types.int32, types.float32)
            and isinstance(indices.dtype, types.Integer) and not indices.dtype.signed):
        return None
    signature = types.void(table, indices, out, start)

    def codegen(context, builder, sig, args):
        lanes = _GATHER_LANES
        table_arr, index_arr, out_arr = (context.make_array(t)(context, builder, a)
                                         for t, a in zip(sig.args[:3], args[:3], strict=True))
        element = context.get_data_type(sig.args[0].dtype)
        size = context.get_abi_sizeof(element)
        i32, i64 = ir.IntType(32), ir.IntType(64)
        index_vector = ir.VectorType(context.get_data_type(sig.args[1].dtype), lanes)
        index_ptr = builder.bitcast(builder.gep(index_arr.data, [args[3]]), index_vector.as_pointer())
        index = builder.zext(builder.load(index_ptr, align=1), ir.VectorType(i64, lanes))
        wide = ir.VectorType(i64, lanes)
        base = builder.insert_element(ir.Constant(wide, None), builder.ptrtoint(table_arr.data, i64),
                                      ir.Constant(i32, 0))
        lane0 = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)
        base = builder.shuffle_vector(base, ir.Constant(wide, None), lane0)  # the table's address in every lane
        address = builder.add(base, builder.mul(index, ir.Constant(wide, [size] * lanes)))
        pointers = builder.inttoptr(address, ir.VectorType(element.as_pointer(), lanes))
        values = ir.VectorType(element, lanes)
        kind = "f32" if isinstance(element, ir.FloatType) else "i32"
        mask = ir.VectorType(ir.IntType(1), lanes)
        gather = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(values, [pointers.type, i32, mask, values]),
            f"llvm.masked.gather.v{lanes}{kind}.v{lanes}p0{kind}")
        got = builder.call(gather, [pointers, ir.Constant(i32, size), ir.Constant(mask, [1] * lanes),
                                    ir.Constant(values, None)])
        out_ptr = builder.bitcast(builder.gep(out_arr.data, [args[3]]), values.as_pointer())
        builder.store(got, out_ptr, align=1)
        return context.get_dummy_value()

    return signature, codegen


# -- bit masks and compressed stores (LLVM vector IR, lowered per CPU: AVX-512 mask registers and
# vcompressps on CPUs that have them, equivalent scalar code elsewhere; the same results everywhere) ----
def _vector_pointer(context, builder, array_type, array, start, vector):  # noqa: ANN001, ANN202
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [start]), vector.as_pointer())


def _is(array, dtype) -> bool:  # noqa: ANN001
    return isinstance(array, types.Array) and array.dtype == dtype and array.layout == "C"


@intrinsic
def sign_bits64(typingctx, bits, start):  # pragma: no cover - compiled
    """Bit j (j < 64) = [x ≥ 0] for the float32 at ``bits[start + j]`` (uint32 patterns): the sign bit
    clear or a zero of either sign, i.e. pattern ≤ 0x80000000. One vector compare per 16 values."""
    if not (_is(bits, types.uint32) and isinstance(start, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(ir.IntType(32), 64)
        values = builder.load(_vector_pointer(context, builder, signature.args[0], args[0], args[1], vector), align=4)
        mask = builder.icmp_unsigned("<=", values, ir.Constant(vector, [0x80000000] * 64))
        return builder.bitcast(mask, ir.IntType(64))

    return types.uint64(bits, start), codegen


@intrinsic
def sign_flags64(typingctx, bits, start):  # pragma: no cover - compiled
    """(signs, non-finite, non-zero): three words for the float32 patterns ``bits[start:start + 64]``,
    from one load. Bit j of each: the sign bit of :func:`sign_bits64` ([x ≥ 0]); |x| is Inf or NaN
    (|pattern| ≥ 0x7F800000); x ≠ 0. A kernel or-s the last two over a tensor for its checks."""
    if not (_is(bits, types.uint32) and isinstance(start, types.Integer)):
        return None
    words = types.UniTuple(types.uint64, 3)

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(ir.IntType(32), 64)
        values = builder.load(_vector_pointer(context, builder, signature.args[0], args[0], args[1], vector), align=4)
        magnitudes = builder.and_(values, ir.Constant(vector, [0x7FFFFFFF] * 64))
        masks = [builder.icmp_unsigned("<=", values, ir.Constant(vector, [0x80000000] * 64)),
                 builder.icmp_unsigned(">=", magnitudes, ir.Constant(vector, [0x7F800000] * 64)),
                 builder.icmp_unsigned("!=", magnitudes, ir.Constant(vector, [0] * 64))]
        return context.make_tuple(builder, words, [builder.bitcast(m, ir.IntType(64)) for m in masks])

    return words(bits, start), codegen


def _abs_compare64(ordered: bool, op: str):  # noqa: ANN202
    """An intrinsic (x, start, threshold) -> uint64 whose bit j (j < 64) compares |x[start + j]| (float32)
    with ``threshold``: ``fcmp`` ordered (NaN: 0) or unordered (NaN: 1) with ``op``."""

    @intrinsic
    def compare(typingctx, x, start, threshold):  # pragma: no cover - compiled
        if not (_is(x, types.float32) and isinstance(start, types.Integer) and threshold == types.float32):
            return None

        def codegen(context, builder, signature, args):
            vector = ir.VectorType(ir.FloatType(), 64)
            values = builder.load(_vector_pointer(context, builder, signature.args[0], args[0], args[1], vector),
                                  align=4)
            fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector]),
                                                  "llvm.fabs.v64f32")
            splat = builder.shuffle_vector(
                builder.insert_element(ir.Constant(vector, None), args[2], ir.Constant(ir.IntType(32), 0)),
                ir.Constant(vector, None), ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64))
            fcmp = builder.fcmp_ordered if ordered else builder.fcmp_unordered
            return builder.bitcast(fcmp(op, builder.call(fabs, [values]), splat), ir.IntType(64))

        return types.uint64(x, start, threshold), codegen

    return compare


#: bit j (j < 64) = not |x[start + j]| < threshold: set for |x| ≥ threshold and for NaN
abs_not_below64 = _abs_compare64(False, ">=")
#: bit j (j < 64) = |x[start + j]| > threshold: clear for NaN
abs_above64 = _abs_compare64(True, ">")


@intrinsic
def select_bits64(typingctx, word, low, high, out, start):  # pragma: no cover - compiled
    """out[start + j] = high if bit j of ``word`` is set, else low (j < 64; float32)."""
    if not (word == types.uint64 and low == types.float32 and high == types.float32 and _is(out, types.float32)
            and isinstance(start, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(ir.FloatType(), 64)
        lanes0 = ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64)
        zero = ir.Constant(ir.IntType(32), 0)
        low_v = builder.shuffle_vector(builder.insert_element(ir.Constant(vector, None), args[1], zero),
                                       ir.Constant(vector, None), lanes0)
        high_v = builder.shuffle_vector(builder.insert_element(ir.Constant(vector, None), args[2], zero),
                                        ir.Constant(vector, None), lanes0)
        mask = builder.bitcast(args[0], ir.VectorType(ir.IntType(1), 64))
        pointer = _vector_pointer(context, builder, signature.args[3], args[3], args[4], vector)
        builder.store(builder.select(mask, high_v, low_v), pointer, align=4)
        return context.get_dummy_value()

    return types.void(word, low, high, out, start), codegen


def _compress16(predicate: str, doc: str):  # noqa: ANN202
    """An intrinsic writing those of the 16 float32 x[start:start + 16] (or of the 16 lanes of a
    :data:`~gradpress.kernels.simd.vf32` x, standing for those positions) for which ``fcmp predicate |x|,
    threshold`` holds (a leading "u": unordered, true for NaN), in order, to values[at:] and their
    positions (int32) to indices[at:], returning how many: compressed in registers
    (``vcompressps``/``vpcompressd`` with AVX-512, equivalent scalar code elsewhere), then one unaligned
    16-wide store each, so both outputs need 16 slots from ``at`` whatever the count."""

    @intrinsic
    def compress16(typingctx, x, start, threshold, values, indices, at):  # pragma: no cover - compiled
        if not ((_is(x, types.float32) or x == V.vf32) and _is(values, types.float32)
                and _is(indices, types.int32) and isinstance(start, types.Integer)
                and threshold == types.float32 and isinstance(at, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            floats, ints = ir.VectorType(ir.FloatType(), 16), ir.VectorType(i32, 16)
            mask_type = ir.VectorType(ir.IntType(1), 16)
            lanes0 = ir.Constant(ints, [0] * 16)
            module, kinds = builder.module, signature.args

            def splat(value, vector):  # noqa: ANN001, ANN202
                one = builder.insert_element(ir.Constant(vector, None), value, ir.Constant(i32, 0))
                return builder.shuffle_vector(one, ir.Constant(vector, None), lanes0)

            def function(name, result, arguments):  # noqa: ANN001, ANN202
                return cgutils.get_or_insert_function(module, ir.FunctionType(result, arguments), name)

            x_v = args[0] if kinds[0] == V.vf32 else \
                builder.load(_vector_pointer(context, builder, kinds[0], args[0], args[1], floats), align=4)
            magnitude = builder.call(function("llvm.fabs.v16f32", floats, [floats]), [x_v])
            t = splat(args[2], floats)
            mask = builder.fcmp_unordered(predicate[1:], magnitude, t) if predicate[0] == "u" \
                else builder.fcmp_ordered(predicate, magnitude, t)
            base = builder.trunc(args[1], i32) if args[1].type.width > 32 else args[1]
            positions = builder.add(splat(base, ints), ir.Constant(ints, list(range(16))))
            # the values compressed as their bits: LLVM's expansion of a float vector.compress for CPUs
            # without AVX-512 fails an assertion (SelectionDAG::getConstant, "Cannot create FP integer
            # constant") and aborts the process; the integer form compiles everywhere, to the same
            # vpcompressd where AVX-512 has it
            compress_i = function("llvm.experimental.vector.compress.v16i32", ints, [ints, mask_type, ints])
            builder.store(builder.call(compress_i, [builder.bitcast(x_v, ints), mask, ir.Constant(ints, None)]),
                          _vector_pointer(context, builder, kinds[3], args[3], args[5], ints), align=4)
            builder.store(builder.call(compress_i, [positions, mask, ir.Constant(ints, None)]),
                          _vector_pointer(context, builder, kinds[4], args[4], args[5], ints), align=4)
            ctpop = function("llvm.ctpop.i16", ir.IntType(16), [ir.IntType(16)])
            count = builder.call(ctpop, [builder.bitcast(mask, ir.IntType(16))])
            return builder.zext(count, ir.IntType(64))

        return types.int64(x, start, threshold, values, indices, at), codegen

    compress16.__doc__ = (f"Those of the 16 values x[start:start + 16] with {doc}, as :func:`_compress16` "
                          "writes them.")
    return compress16


compress_above16 = _compress16(">", "|x| > threshold, NaN not (threshold-v's selection)")
compress_at_least16 = _compress16("u>=", "not |x| < threshold: at or above it, and NaN (top-k's candidates)")


# -- unaligned 64-bit words of a byte array (the packing of gradpress.kernels.bits' whole groups) -------------------
def _byte_pointer(context, builder, array_type, array, offset):  # pragma: no cover - compiled
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), ir.IntType(64).as_pointer())


@intrinsic
def load64(typingctx, array, offset):  # pragma: no cover - compiled
    """The 8 bytes of a uint8 array at byte ``offset`` as a uint64 (any alignment; numba's hosts are all
    little-endian, the layout of :mod:`gradpress.kernels.bits`)."""
    sig = types.uint64(array, types.intp)

    def codegen(context, builder, signature, args):
        return builder.load(_byte_pointer(context, builder, signature.args[0], args[0], args[1]), align=1)

    return sig, codegen


@intrinsic
def store64(typingctx, array, offset, value):  # pragma: no cover - compiled
    """Write ``value`` as 8 (little-endian) bytes at byte ``offset`` of a uint8 array (any alignment)."""
    sig = types.void(array, types.intp, types.uint64)

    def codegen(context, builder, signature, args):
        builder.store(args[2], _byte_pointer(context, builder, signature.args[0], args[0], args[1]), align=1)
        return context.get_dummy_value()

    return sig, codegen


@jit
def squares(x, addends=None, streamed=False):  # pragma: no cover - compiled
    """Σ x_i² in float64 for float32 ``x``: every square exact in float64, summed per lane of 16 (lane
    k mod 16), the lanes in order, then the last x.size mod 16 values in order — one fixed order, so a
    given x always gives the same bits. ``addends`` (m, g, β, γ) or None: x is not read but written, the
    value squared being φ = fl32(fl32(m·β) + fl32(g·γ)) (:func:`~gradpress.core.compressor.scaled_sum`'s bits;
    error feedback's sum formed in the pass that takes its norm), stored past the caches if ``streamed``."""
    u = np.uint64
    n = u(x.size)
    whole = n - n % u(16)
    xp = V.pointer(x)
    acc = V.zeros64()
    if addends is None:
        for k in range(u(0), whole, u(16)):
            acc = V.add_squares64(acc, V.load(xp, k))
    else:
        mp, gp = V.pointer(addends[0]), V.pointer(addends[1])
        bs, gs = V.fsplat(addends[2]), V.fsplat(addends[3])
        for k in range(u(0), whole, u(16)):
            v = V.add(V.mul(V.load(mp, k), bs), V.mul(V.load(gp, k), gs))
            if streamed:
                V.store_stream(xp, k, v)
            else:
                V.store(xp, k, v)
            acc = V.add_squares64(acc, v)
    total = V.hsum(acc)
    for k in range(whole, n):
        if addends is not None:
            x[k] = addends[0][k] * addends[2] + addends[1][k] * addends[3]
        total += np.float64(x[k]) * np.float64(x[k])
    return total


# -- an all-gather's sum, fused into the decoders (Compressor.accumulate_into) ----------------------------
#: how a decode-add kernel folds a decoded value into the float32 total: ``ADD`` total += v; ``STORE`` (the
#: first packet) total = v + 0.0, the bits of 0.0 + v (a −0.0 stored as +0.0) without reading the total;
#: ``FINISH`` (the last packet) total = (total + v) / count, ``FINISH_POW2`` the same for a power-of-two
#: count as a product with its reciprocal (both the correctly rounded quotient). Kernels take the mode and
#: the count as arguments and dispatch on the mode once, outside their loops, to code compiled for it
#: (:func:`fold` with a constant mode: its other branches and the exponent max compile away).
ADD, STORE, FINISH, FINISH_POW2 = 0, 1, 2, 3
fused = kernel(error_model="numpy")  # numpy's division: no zero check per element


def fold_mode(store: bool, count: int) -> int:
    """The kernel mode of one step (``count`` > 0: the last packet, divided by ``count``)."""
    if store:
        return STORE
    if count:
        return FINISH_POW2 if count & (count - 1) == 0 else FINISH
    return ADD


@kernel(inline="always")
def fold(old, value, mode, count, reciprocal):  # pragma: no cover - compiled
    """The total's new value (see :data:`ADD`); ``count`` and ``reciprocal`` float32."""
    if mode == STORE:
        return value + np.float32(0.0)
    if mode == FINISH:
        return (old + value) / count
    if mode == FINISH_POW2:
        return (old + value) * reciprocal
    return old + value


@kernel(inline="always")
def fold_top(top, mode, value):  # pragma: no cover - compiled
    """``top`` raised to ``value``'s exponent field in the finishing modes (all ones: a NaN or Inf)."""
    if mode >= FINISH:
        return max(top, np.int32(bits_of_f32(value) & np.uint32(0x7F800000)))
    return top
