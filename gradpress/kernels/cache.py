"""The numba decorator of every gradpress kernel (:func:`kernel`, :data:`jit`) and its on-disk cache.

Compiled kernels are kept on disk (:class:`KernelCache`): under ``$GRADPRESS_CACHE/numba`` when that
variable is set (else under numba's ``NUMBA_CACHE_DIR`` when that one is), else beside the package's
modules (``__pycache__``) where that is writable, else in the user's cache
(``$XDG_CACHE_HOME/gradpress/numba``, by default ``~/.cache/gradpress/numba``). A kernel compiled beside
the modules before (by ``gradpress compile`` when an image was built, say) is read from there in any case.
Installs of one version at different places share the kernels of a shared folder (``GRADPRESS_CACHE``, the
user's cache): a virtualenv finds those that a checkout or another virtualenv compiled from the same
sources. A cached kernel is valid only for the sources it was compiled from (:func:`sources_digest`).
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

from numba import njit
from numba.core import config
from numba.core.caching import CompileResultCacheImpl, FunctionCache, IndexDataCacheFile, _CacheLocator

from gradpress._version import __version__

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
    also contains what the kernel inlined from other modules: the intrinsics of ``scalar``, ``masks``
    and the ``simd`` modules,
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
