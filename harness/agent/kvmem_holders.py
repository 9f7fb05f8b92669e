"""Who holds MLX memory: every live MLX array found from the roots a maintainer can open, each
unique buffer attributed to the shortest path that reaches it, paths grouped by their holder.
Standalone (the standard library and the process's own MLX): it runs inside a server kvmem
starts and in kvmem's own variant processes, so a `Group` travels as a plain tuple.

The walk is breadth-first from every root at once: module globals, each thread's frames, then
(when given) the objects unreachable reference cycles hold. It follows gc-tracked objects only,
never enters a module or a function's globals, and treats arrays as leaves. It runs at rest,
evaluates no array, allocates no MLX memory and keeps nothing alive. See docs/holders.md.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import re
import sys
import threading
import time
import types
from collections.abc import Callable, Collection, Iterable
from typing import Any, NamedTuple

if __package__:  # harness.agent.kvmem_holders, in kvmem's own processes
    from . import kvmem_buffers
else:  # kvmem_holders, beside it on a server's PYTHONPATH
    import kvmem_buffers  # type: ignore[import-not-found,no-redef]

UNROOTED = "(unrooted)"
# What is not the program's: the interpreter, the standard library and kvmem itself.
OWN = frozenset({"harness", "kvmem_agent", "kvmem_follow", "kvmem_holders", "kvmem_rest",
                 "kvmem_buffers", "kvmem_sample"})
FOREIGN = frozenset(sys.stdlib_module_names) | {"builtins"} | OWN
# Objects that hold no array, or none a maintainer could name (descriptors of C types, code).
SKIP = frozenset({int, float, complex, str, bytes, bool, type(None), range, types.CodeType,
                  types.MethodDescriptorType, types.WrapperDescriptorType,
                  types.GetSetDescriptorType, types.MemberDescriptorType,
                  types.ClassMethodDescriptorType, types.MethodWrapperType, types.ModuleType})
HEAP_TYPE = 1 << 9       # Py_TPFLAGS_HEAPTYPE: a type whose dict can be given attributes
CO_OPTIMIZED = 1         # a function's frame: its f_locals is a snapshot (before Python 3.13)
KEY_REPR = 40            # a key's repr in a full path is cut to this many characters
ROOT, ITEM, INDEX, MEMBER, ATTR, LOCAL, REF = range(7)  # edge kinds: how a node was reached


class Group(NamedTuple):
    """The MLX arrays one holder keeps, and the unique buffers attributed to it."""

    holder: str    # the path, anchored at the program's object and with indices collapsed
    path: str      # one full path from its root (the shortest), indices and keys kept
    root: str      # "global" | "frame" | "cycle" | "unrooted"
    bytes: int     # allocator bytes of the unique buffers attributed here (each in one group)
    logical: int   # the sum of its arrays' nbytes
    arrays: int    # its arrays, evaluated and pending
    buffers: int   # its unique buffers, with the evaluated inputs its pending graphs hold
    pending: int   # its arrays not yet evaluated


class Census(NamedTuple):
    """Every holder of MLX memory at one point at rest."""

    groups: list[Group]   # most bytes first (then most buffers, then the name)
    arrays: int
    buffers: int
    bytes: int            # the groups' bytes: every unique buffer behind an evaluated array
    objects: int          # Python objects the walk visited
    seconds: float        # the walk's wall time
    approximate: bool     # this MLX lacks get_array_buffer_size: bytes are nbytes, buffers arrays


def buffer_limit(mx: Any) -> int | None:
    """The backend's limit on live buffers where MLX reports it (Metal), else None."""
    try:
        limit = mx.device_info().get("resource_limit")
    except Exception:
        return None
    return int(limit) if limit else None


def _foreign(kind: type) -> bool:
    module = kind.__module__
    return not isinstance(module, str) or module.partition(".")[0] in FOREIGN


def _cycle_core(garbage: list) -> list[tuple[object, str]]:
    """The garbage objects that form cycles, each with "cycle of A, B", the types of its cycle:
    what is left once objects that refer to no other garbage (arrays, tuples of them) are taken
    away, again and again."""
    index = {id(obj): i for i, obj in enumerate(garbage)}
    edges = [[index[id(r)] for r in gc.get_referents(obj) if id(r) in index] for obj in garbage]
    referrers: list[list[int]] = [[] for _ in garbage]
    for source, targets in enumerate(edges):
        for target in targets:
            referrers[target].append(source)
    out = [len(targets) for targets in edges]
    gone = [i for i, n in enumerate(out) if n == 0]
    removed = set(gone)
    while gone:
        for source in referrers[gone.pop()]:
            out[source] -= 1
            if out[source] == 0 and source not in removed:
                removed.add(source)
                gone.append(source)
    component = {i: i for i in range(len(garbage)) if i not in removed}
    for i in component:
        for j in edges[i]:
            if j in component:
                component[_find(component, j)] = _find(component, i)
    kinds: dict[int, list[type]] = {}
    own = {id(_instance_dict(obj)) for obj in garbage if type(obj).__dictoffset__}  # their dicts
    for i in component:
        members = kinds.setdefault(_find(component, i), [])
        if type(garbage[i]) not in members and id(garbage[i]) not in own:
            members.append(type(garbage[i]))
    return [(garbage[i], "cycle of " + ", ".join(
        kind.__qualname__ for kind in sorted(kinds[_find(component, i)], key=_foreign)))
        for i in component]


def _find(component: dict[int, int], i: int) -> int:
    while component[i] != i:
        i = component[i]
    return i


class _Walk:
    """One breadth-first walk: node i is `objects[i]`, reached from `parents[i]` by an edge of
    kind `kinds[i]` and key `keys[i]` (a root's key is its label)."""

    def __init__(self, array_type: type, seen: set[int],
                 skip_modules: Collection[str] = ()) -> None:
        self.array_type = array_type
        self.seen = seen
        self.skip_modules = skip_modules
        self.objects: list = []
        self.parents: list[int] = []
        self.kinds: list[int] = []
        self.keys: list = []
        self.arrays: list[int] = []
        self.roots: dict[int, tuple[str, str]] = {}  # root node → root kind, label's prefix
        self.snapshots: list[dict] = []      # f_locals dicts the walk made (emptied after)

    def add(self, parent: int, kind: int, keys: Any, values: Any) -> None:
        """Appends the children not seen yet that may hold an array (the hot loop). Without
        `keys`, a child's key is found from its parent later, for those on a path only."""
        seen, objects, is_tracked = self.seen, self.objects, gc.is_tracked
        fresh = [c for c in values if type(c) not in SKIP and id(c) not in seen and is_tracked(c)]
        if not fresh:
            return
        named = None if keys is None else {id(v): k for k, v in zip(keys, values, strict=True)}
        for child in fresh:
            if id(child) in seen:  # twice in one batch
                continue
            seen.add(id(child))
            if type(child) is self.array_type:
                self.arrays.append(len(objects))
            objects.append(child)
            self.parents.append(parent)
            self.kinds.append(kind)
            self.keys.append(None if named is None else named[id(child)])

    def root(self, kind: str, prefix: str, names: Any, values: Any) -> None:
        """Roots labelled `prefix + name` (formatted only for those on a path to an array)."""
        before = len(self.objects)
        self.add(-1, ROOT, names, values)
        self.roots.update(dict.fromkeys(range(before, len(self.objects)), (kind, prefix)))

    def run(self, start: int = 0) -> None:
        """Expands every node from `start` on, the nodes it adds included."""
        node, objects, array = start, self.objects, self.array_type
        handlers: dict[type, Callable[[_Walk, Any], Batches]] = {}
        while node < len(objects):
            obj = objects[node]
            exact = type(obj)
            if exact is dict:  # the common containers first, without a call
                self.add(node, ITEM, None, list(obj.values()))
            elif exact is list or exact is tuple:
                self.add(node, INDEX, None, obj)
            elif exact is not array:
                handler = handlers.get(exact)
                if handler is None:
                    handler = handlers[exact] = _handler(exact)
                for kind, keys, values in handler(self, obj):
                    self.add(node, kind, keys, values)
            node += 1

    def instance(self, obj: object) -> Batches:
        """An object's attributes: named from its `__dict__` where that dict already exists (a
        dict is made only for an object that has a dict among its attributes), otherwise as
        referents, named later for those on a path to an array only."""
        referents = gc.get_referents(obj)
        if type(obj).__dictoffset__ and any(type(r) is dict for r in referents):
            own = _instance_dict(obj)
            if own is not None and any(r is own for r in referents):
                self.seen.add(id(own))
                referents += _listed(own.values())
        return [(REF, None, referents)]

    def skipped(self, defined: Any) -> bool:
        """Whether a module is one whose globals are no roots, or a class or function comes
        from one: what it refers to (attributes, defaults, closure) is not the program's."""
        module, skip = getattr(defined, "__module__", defined.__name__), self.skip_modules
        return isinstance(module, str) and (module in skip or module.partition(".")[0] in skip)

    def frame_locals(self, frame: types.FrameType) -> Any:
        """A frame's locals. Before Python 3.13 reading `f_locals` of a function's frame stores a
        snapshot dict in the frame, which would keep its values alive: it is emptied after the
        walk."""
        found = frame.f_locals
        if type(found) is dict and frame.f_code.co_flags & CO_OPTIMIZED:
            self.snapshots.append(found)
        return found.items()


Batches = list[tuple[int, Any, Any]]  # what an object refers to: (edge kind, keys, values)


def _handler(kind: type) -> Callable[[_Walk, Any], Batches]:
    """How objects of `kind` are expanded: modules never (their globals are roots), subclasses
    of the containers as their base (with their own attributes where the program made them),
    metaclasses' instances as classes, other objects by their referents."""
    if kind in EXACT:
        return EXACT[kind]
    if issubclass(kind, types.ModuleType):
        return lambda walk, obj: []
    for base, handler in EXACT.items():
        if issubclass(kind, base):
            if _foreign(kind) or base is type:
                return handler
            return lambda walk, obj: handler(walk, obj) + walk.instance(obj)
    return _Walk.instance


def _mapping(walk: _Walk, obj: dict) -> Batches:
    """Items; a str key of a dict class of the program's is an attribute (mlx.nn.Module)."""
    return [(ITEM if _foreign(type(obj)) else ATTR, None, _listed(dict.values(obj)))]


def _class(walk: _Walk, obj: type) -> Batches:
    """A class's own attributes; a C type's dict holds descriptors only, and a class of a
    skipped module holds none of the program's."""
    if not obj.__flags__ & HEAP_TYPE or walk.skipped(obj):
        return []
    return [(ATTR, None, _listed(vars(obj).values()))]


def _function(walk: _Walk, obj: types.FunctionType) -> Batches:
    """A function's closure (named by its free variables) and defaults, never its globals,
    nor anything of a function of a skipped module's."""
    if walk.skipped(obj):
        return []
    batch: Batches = [(ATTR, ("__defaults__", "__kwdefaults__"),
                       (obj.__defaults__, obj.__kwdefaults__))]
    if obj.__closure__:
        names, values = [], []
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__, strict=True):
            with contextlib.suppress(ValueError):  # an empty cell
                values.append(cell.cell_contents)
                names.append(name)
        batch.append((ATTR, names, values))
    return batch


def _cell(walk: _Walk, obj: types.CellType) -> Batches:
    with contextlib.suppress(ValueError):  # an empty cell
        return [(ATTR, ("cell_contents",), (obj.cell_contents,))]
    return []


def _suspended(walk: _Walk, obj: Any) -> Batches:
    """A suspended generator or coroutine: its frame's locals."""
    name = next(n for n in ("gi_frame", "cr_frame", "ag_frame") if hasattr(obj, n))
    return [(ATTR, (name,), (getattr(obj, name),))]


EXACT: dict[Any, Callable[[_Walk, Any], Batches]] = {
    dict: _mapping, list: lambda walk, obj: [(INDEX, None, _listed(obj))],
    set: lambda walk, obj: [(MEMBER, None, _listed(obj))],
    type: _class, types.FunctionType: _function, types.CellType: _cell,
    types.MethodType: lambda walk, obj: [(ATTR, ("__self__", "__func__"),
                                          (obj.__self__, obj.__func__))],
    types.FrameType: lambda walk, obj: [(LOCAL, *_pairs(walk.frame_locals(obj)))],
    types.GeneratorType: _suspended, types.CoroutineType: _suspended,
    types.AsyncGeneratorType: _suspended}
EXACT[frozenset] = EXACT[set]
EXACT[tuple] = EXACT[collections.deque] = EXACT[list]


def _pairs(items: Any) -> tuple[Any, Any]:
    """Keys and values of a mapping's items, copied at once."""
    listed = _listed(items)
    return tuple(zip(*listed, strict=True)) if listed else ((), ())  # type: ignore[return-value]


def _listed(collection: Any) -> list:
    try:
        return list(collection)
    except RuntimeError:  # changed by another thread meanwhile: it is walked as it is next time
        return []


def _instance_dict(obj: object) -> dict | None:
    try:
        own = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return own if type(own) is dict else None


COLLECTION = (ITEM, INDEX, MEMBER)


def _hop(walk: _Walk, node: int, full: bool) -> str:
    """The edge into `node` as a path shows it: in a holder's name keys and indices are `[*]`."""
    kind, key = walk.kinds[node], walk.keys[node]
    if kind == MEMBER or (kind in COLLECTION and not full):
        return "[*]"
    if key is None:
        key = _key(walk.objects[walk.parents[node]], walk.objects[node])
    if kind in COLLECTION:
        return f"[{repr(key)[:KEY_REPR]}]"
    return f"/{key}" if kind == LOCAL else f".{key}"


def _key(parent: Any, child: object) -> object:
    """The key, index or attribute under which `parent` holds `child`."""
    if isinstance(parent, type):
        items: Any = vars(parent).items()
    elif isinstance(parent, dict):
        items = dict.items(parent)
    elif isinstance(parent, (list, tuple, collections.deque)):
        items = enumerate(parent)
    else:
        return _attribute(parent, child)
    return next((key for key, value in _listed(items) if value is child), "?")


def _attribute(parent: object, child: object) -> str:
    """The name under which `parent` holds `child`, found for the objects on a path only."""
    own = _instance_dict(parent) if type(parent).__dictoffset__ else None
    for key, value in _listed((own or {}).items()):
        if value is child:
            return str(key)
    for kind in type(parent).__mro__:
        for name in vars(kind).get("__slots__", ()):
            mangled = f"_{kind.__name__.lstrip('_')}{name}" if name.startswith("__") else name
            slot = vars(kind).get(mangled)
            if isinstance(slot, types.MemberDescriptorType):
                try:
                    if slot.__get__(parent, kind) is child:
                        return name
                except AttributeError:
                    continue
    return f"<{type(child).__qualname__}>"


def _collapsed(hops: Iterable[str]) -> str:
    """Hops joined, three `[*]` or more as `[*]...[*]`: a nest of any depth is one holder."""
    return re.sub(r"(?:\[\*\]){3,}", "[*]...[*]", "".join(hops))


def _chain(walk: _Walk, node: int) -> list[int]:
    chain = []
    while node != -1:
        chain.append(node)
        node = walk.parents[node]
    return chain[::-1]


def _names(walk: _Walk, node: int) -> tuple[str, str, str]:
    """An array's holder name, its full path and its root kind. The name starts at the first
    object on the path whose class is the program's, follows attribute hops while they stay the
    program's, and anchors at the last such object before a collection; with none, it starts at
    the root's label (a cycle's function named where it is defined)."""
    chain = _chain(walk, node)
    root, objects = chain[0], chain[:-1]
    kind, prefix = walk.roots[root]
    label = f"{prefix}{walk.keys[root]}"
    if kind == "cycle":
        first = walk.objects[root]
        label = f"({label}) " + (f"{first.__module__}:{first.__qualname__}"
                                 if isinstance(first, types.FunctionType)
                                 else f"<{type(first).__qualname__}>")
    path = label + "".join(_hop(walk, n, True) for n in chain[1:])
    first = next((i for i, n in enumerate(objects) if not _foreign(type(walk.objects[n]))), None)
    if first is None:
        return label + _collapsed(_hop(walk, n, False) for n in chain[1:]), path, kind
    anchor = first
    while anchor + 1 < len(objects) and walk.kinds[objects[anchor + 1]] not in COLLECTION \
            and not _foreign(type(walk.objects[objects[anchor + 1]])):
        anchor += 1
    held = type(walk.objects[chain[anchor]])
    holder = f"{held.__module__}:{held.__qualname__}" + _collapsed(
        _hop(walk, n, False) for n in chain[anchor + 1:])
    return (f"{holder} ({walk.keys[root]})" if kind == "cycle" else holder), path, kind


def _roots(walk: _Walk, skip_threads: Collection[int], start: types.FrameType | None) -> None:
    """Module globals first, then every thread's frames, innermost first (the calling thread's
    from `start`)."""
    registered = [(name, m) for name, m in _listed(sys.modules.items())
                  if isinstance(m, types.ModuleType)]
    known = {id(m) for _, m in registered}  # a skipped module found in a global stays skipped
    modules = [(name, m) for name, m in registered if not walk.skipped(m)]
    for name, module in modules:  # grows: submodules not in sys.modules (mlx.core.random)
        keys, values = _pairs(vars(module).items())
        for value in values:
            if isinstance(value, types.ModuleType) and id(value) not in known:
                known.add(id(value))
                walk.seen.add(id(vars(value)))
                modules.append((value.__name__, value))
        walk.root("global", f"{name}:", keys, values)
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident in skip_threads:
            continue
        current: types.FrameType | None = start if ident == me else frame
        while current is not None:
            code = current.f_code
            label = f"{current.f_globals.get('__name__', '?')}:" \
                    f"{getattr(code, 'co_qualname', code.co_name)}()/"
            walk.root("frame", label, *_pairs(walk.frame_locals(current)))
            current = current.f_back
    del frame  # the last one iterated may be this frame: a cycle holding the whole walk


def _cycles(walk: _Walk, garbage: list) -> None:
    """What only unreachable cycles hold, from the objects that form the cycles."""
    start = len(walk.objects)
    for obj, label in _cycle_core(garbage):
        walk.root("cycle", "", (label,), (obj,))
    walk.run(start)


def _tally(mx: Any, found: list[tuple[Any, str, str, str]]) -> list[Group]:
    """The groups of (array, holder, path, root) in walk order: a buffer counts for the holder
    of the first array behind it."""
    exact = hasattr(mx, "get_array_buffer_size")
    sizes: list[int | None] = []
    for array, *_ in found:
        try:
            sizes.append(mx.get_array_buffer_size(array) if exact else array.nbytes)
        except ValueError:  # not evaluated: its buffers are in its graph
            sizes.append(None)
    done = [(i, size) for i, size in enumerate(sizes) if size is not None]
    first = kvmem_buffers.unique(mx, [found[i][0] for i, _ in done], [size for _, size in done]) \
        if exact else list(range(len(done)))
    stats: dict[str, list] = {}
    for i, (array, holder, path, root) in enumerate(found):
        entry = stats.setdefault(holder, [path, root, 0, 0, 0, 0, []])
        entry[3] += array.nbytes
        entry[4] += 1
        if sizes[i] is None:
            entry[6].append(array)
    for k, (i, size) in enumerate(done):
        if first[k] == k and size:
            stats[found[i][1]][2] += size
            stats[found[i][1]][5] += 1
    groups = [Group(holder, path, root, held, logical, arrays,
                    buffers + kvmem_buffers.graph_buffers(mx, pending), len(pending))
              for holder, (path, root, held, logical, arrays, buffers, pending) in stats.items()]
    return sorted(groups, key=lambda g: (-g.bytes, -g.buffers, g.holder))


def census(mx: Any, *, garbage: list | None = None, skip_threads: Collection[int] = (),
           skip_frame: types.FrameType | None = None,
           skip_modules: Collection[str] = ()) -> Census:
    """Every live MLX array, grouped by the holder on the shortest path to it from a root.

    `garbage` (from `kvmem_rest.unreachable()`) adds what only unreachable cycles hold;
    `skip_threads` leaves those threads' frames out; in the calling thread the walk starts at
    `skip_frame`'s caller (default: this function's caller); the globals of `skip_modules`, and
    of every module of a package named there, are no roots (kvmem's own, in a variant's
    process: most of what a walk would visit there)."""
    began = time.perf_counter()
    enabled = gc.isenabled()
    gc.disable()
    seen = {id(vars(m)) for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)}
    seen.add(id(garbage))
    walk = _Walk(mx.array, seen, skip_modules)
    try:
        _roots(walk, skip_threads, skip_frame.f_back if skip_frame else sys._getframe(1))
        walk.run()
        if garbage:
            _cycles(walk, garbage)
        found = [(walk.objects[n], *_names(walk, n)) for n in walk.arrays]
        found += [(obj, UNROOTED, UNROOTED, "unrooted") for obj in gc.get_objects()
                  if type(obj) is mx.array and id(obj) not in seen]
        groups = _tally(mx, found)
        visited = len(walk.objects)
    finally:
        for snapshot in walk.snapshots:
            snapshot.clear()
        del walk
        if enabled:
            gc.enable()
    return Census(groups, sum(g.arrays for g in groups), sum(g.buffers for g in groups),
                  sum(g.bytes for g in groups), visited, time.perf_counter() - began,
                  not hasattr(mx, "get_array_buffer_size"))
