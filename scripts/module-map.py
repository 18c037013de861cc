#!/usr/bin/env python3
"""The module map of a crate: which module uses which, from `crate::`, `super::` and
`self::` paths in its sources. Prints the edges that make the map not read top to bottom
and exits 1 if there are any:

- cycles between modules (a module set that reaches itself through uses), and
- upward uses: a module using an item of one of its ancestors (a child calling up into
  its parent's helpers). Re-exports (`pub use`) in a parent are downward and fine.

Usage: scripts/module-map.py [--edges] CRATE_SRC_DIR...   (e.g. ztunnel/src waypoint/src)
The crate root (lib.rs / main.rs) is the module `crate`; items defined there (constants)
count as the root's, so using them from anywhere is upward. `#[cfg(test)] mod tests`
blocks are skipped: tests may reach anything.
"""
import os
import re
import sys

USE_PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+|::\{)")


def strip_tests(text):
    """Drops `#[cfg(test)] mod name { ... }` blocks (brace matched) and comments."""
    text = re.sub(r"//[^\n]*", "", text)
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub\s+)?mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def modules(src):
    """Maps module path (tuple) -> file, for a crate laid out as foo.rs + foo/."""
    mods = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(root, f), src)[:-3].split(os.sep)
            if rel in (["lib"], ["main"]):
                path = ()
            else:
                path = tuple(rel)
            if path == () and ("lib",) not in mods and f == "main.rs" and os.path.exists(os.path.join(src, "lib.rs")):
                path = ("<bin>",)
            mods[path] = os.path.join(root, f)
    return mods


def resolve(mods, current, kind, rest):
    """The deepest known module a path names (its item's home)."""
    if kind == "crate":
        base = () if current != ("<bin>",) else ()
    elif kind == "super":
        base = current[:-1]
        while rest[:1] == ["super"]:
            base, rest = base[:-1], rest[1:]
    else:
        base = current
    path = base
    for seg in rest:
        if path + (seg,) in mods:
            path = path + (seg,)
        else:
            break
    return path


def test_only(mods):
    """Modules declared `#[cfg(test)] mod name;` (test code, like inline test modules)."""
    out = set()
    for mod, file in mods.items():
        text = open(file, encoding="utf-8").read()
        for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text):
            out.add(mod + (m.group(1),) if mod != ("<bin>",) else (m.group(1),))
    return out


def edges(src):
    mods = modules(src)
    skip = test_only(mods)
    mods = {m: f for m, f in mods.items() if not any(m[: len(t)] == t for t in skip)}
    out = {}
    for mod, file in mods.items():
        text = strip_tests(open(file, encoding="utf-8").read())
        uses = set()
        for m in USE_PATH.finditer(text):
            kind = m.group(1)
            rest = [s for s in m.group(2).split("::") if s and s != "{"]
            if kind == "crate" and mod == ("<bin>",):
                continue
            target = resolve(mods, mod, kind, rest)
            if target != mod:
                uses.add(target)
        # `use super::*` style globs and brace groups name the parent itself.
        out[mod] = uses
    return mods, out


def name(m):
    return "crate" if m == () else "::".join(m)


def is_reexport_line(text, target):
    return False


def sccs(graph):
    index, low, stack, on, res, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            res.append(comp)

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return res


def main(argv):
    show_edges = "--edges" in argv
    dirs = [a for a in argv if not a.startswith("--")]
    bad = 0
    for src in dirs:
        mods, graph = edges(src)
        if show_edges:
            for m in sorted(graph):
                print(f"{src}: {name(m)} -> {', '.join(sorted(name(t) for t in graph[m]))}")
        upward = sorted((m, t) for m, ts in graph.items() for t in ts if len(t) < len(m) and m[: len(t)] == t)
        # Cycles are judged without upward edges (each is reported once, above).
        down = {m: {t for t in ts if not (len(t) < len(m) and m[: len(t)] == t)} for m, ts in graph.items()}
        cycles = [sorted(c) for c in sccs(down) if len(c) > 1]
        for m, t in upward:
            print(f"{src}: upward use: {name(m)} uses its ancestor {name(t)}")
        for c in cycles:
            print(f"{src}: cycle: {' <-> '.join(name(m) for m in c)}")
        bad += len(upward) + len(cycles)
        print(f"{src}: {len(mods)} modules, {len(upward)} upward uses, {len(cycles)} cycles")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
