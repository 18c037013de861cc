#!/usr/bin/env python3
"""Every relative link in the project's markdown points at a file that exists (and, with
`#anchor`, at a heading of that file), and no file cites documents outside the project.
Every test a doc cites exists: `suite::test_name` (an end-to-end suite of
tests/tests/e2e, or a test binary), `--lib` paths such as `http::plan::tests::name`, and
bare test names in backticks, all looked up among the `#[test]` / `#[tokio::test]`
functions of the repository's .rs files. Exits 1 naming each broken link or missing
test (file and line). `--self-test` shows a missing cited test is caught."""
import os
import re
import subprocess
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def ls(pattern):
    return subprocess.run(["git", "ls-files", pattern], cwd=root, capture_output=True, text=True, check=True).stdout.split()


files = ls("*.md")


def anchors(path):
    """The anchors GitHub makes for a markdown file's headings."""
    seen, out = {}, set()
    text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
    for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        h = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", h)
        slug = re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


bad = []
for f in files:
    text = open(os.path.join(root, f), encoding="utf-8").read()
    # Links outside code spans and fences.
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^(https?:|mailto:)", target):
            continue
        file_part, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(root, os.path.dirname(f), file_part or os.path.basename(f)))
        if not os.path.exists(path):
            bad.append(f"{f}: link to {target} (no such file)")
        elif anchor and path.endswith(".md") and anchor not in anchors(path):
            bad.append(f"{f}: link to {target} (no such heading)")
    if "../shared" in text:
        bad.append(f"{f}: cites ../shared, which is not part of the project")

# Cited tests. A test is a function after #[test] or #[tokio::test(...)] (other attributes
# and comments may sit between them).
TEST_FN = re.compile(r"#\[(?:tokio::)?test(?:\([^)]*\))?\]\s*(?:(?:#\[[^\]]*\]|//[^\n]*)\s*)*(?:pub\s+)?(?:async\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(")
# End-to-end suites (modules of tests/tests/e2e) and test binaries.
E2E = "tests/tests/e2e/"
BINARIES = {"limits", "soak", "demo", "smoke", "cli"}
# A path whose last segment has four or more words, or that goes through a `tests` module.
PATH = re.compile(r"(?<![\w:])([a-z_][a-z0-9_]*(?:::[a-z_][a-z0-9_]*)+)(?![\w:=(])")
# A bare name in backticks with five or more words is read as a test name unless it is a
# word of the sources (a field, a function); shorter ones are too often the kernel's or
# Istio's function names.
BARE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+){4,}$")
# The last segment of a path: four or more words.
PATH_NAME = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+){3,}$")


def test_index(sources):
    """name -> set of files defining a test of that name; and every word of the sources."""
    tests, words = {}, set()
    for path, text in sources.items():
        if path.endswith(".rs"):
            for name in TEST_FN.findall(text):
                tests.setdefault(name, set()).add(path)
        words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    return tests, words


def cited_test_errors(doc, text, tests, words):
    """The cited tests of one markdown text that do not exist, as 'doc:line: ...'."""
    errors = []
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    for lineno, line in enumerate(text.split("\n"), 1):
        for span in re.findall(r"`([^`]+)`", line):
            for path in PATH.findall(span):
                segs = path.split("::")
                name = segs[-1]
                lib = "tests" in segs[:-1] or segs[-2].endswith("_tests")
                if not (PATH_NAME.match(name) or lib):
                    continue  # a module or function path, not a test
                where = tests.get(name, set())
                suite = segs[0]
                if not lib and os.path.exists(os.path.join(root, E2E, suite + ".rs")):
                    # suite::[module::]name: the test lives in that suite's file or folder.
                    prefix = E2E + "/".join(segs[:-1])
                    where = {w for w in where if w == prefix + ".rs" or w.startswith(E2E + suite)}
                if not where:
                    errors.append(f"{doc}:{lineno}: cites test {path}, which does not exist")
            if BARE.match(span.strip()) and span.strip() not in tests and span.strip() not in words:
                errors.append(f"{doc}:{lineno}: cites test {span.strip()}, which does not exist")
    return errors


def self_test():
    sources = {E2E + "l4.rs": "#[tokio::test(flavor = \"multi_thread\")]\n// why\nasync fn same_node_pod_to_pod_works() {}\n",
               "ztunnel/src/x.rs": "mod tests {\n    #[test]\n    #[ignore]\n    fn a_real_unit_test_here() {}\n    fn not_a_test_but_a_helper() {}\n}\n"}
    tests, words = test_index(sources)
    assert set(tests) == {"same_node_pod_to_pod_works", "a_real_unit_test_here"}, tests
    doc = "\n".join([
        "`l4::same_node_pod_to_pod_works` and `--lib x::tests::a_real_unit_test_here` exist,",
        "`a_real_unit_test_here` too; `ztunnel::hbone::server` is a module; `hbone_mtls_port_field_name` a word",
        "`not_a_test_but_a_helper` is code: not flagged, as a bare name found in the sources",
        "```", "`l4::inside_a_fence_is_not_read`", "```",
        "`l4::a_renamed_test_that_is_gone` and `--lib x::tests::gone_unit_test_name`",
        "`xds::same_node_pod_to_pod_works` is in another suite; bare `a_gone_bare_test_name_here`",
    ])
    words.add("hbone_mtls_port_field_name")
    got = cited_test_errors("doc.md", doc, tests, words)
    want = ["doc.md:7: cites test l4::a_renamed_test_that_is_gone, which does not exist",
            "doc.md:7: cites test x::tests::gone_unit_test_name, which does not exist",
            "doc.md:8: cites test a_gone_bare_test_name_here, which does not exist"]
    # xds::... : there is no tests/tests/e2e/xds.rs in the self-test's sources but there is in
    # the repository, so it is looked up in that suite and not found.
    want.insert(2, "doc.md:8: cites test xds::same_node_pod_to_pod_works, which does not exist")
    assert got == want, "\n".join(got)
    print("check-docs self-test: a missing cited test is caught")


if "--self-test" in sys.argv:
    self_test()
    sys.exit(0)

sources = {}
for f in ls("*.rs") + ls("*.proto") + ls("*.go") + ls("*.py") + ls("*.sh") + ls("*.yaml") + ls("*.c") + ls("*.h"):
    try:
        sources[f] = open(os.path.join(root, f), encoding="utf-8").read()
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
        pass
tests, words = test_index(sources)
missing = []
for f in files:
    if f.startswith("docs/benchmarks/"):
        continue  # dated run records, kept as they were written
    missing += cited_test_errors(f, open(os.path.join(root, f), encoding="utf-8").read(), tests, words)

for b in bad + missing:
    print(b)
print(f"check-docs: {len(files)} markdown files, {len(bad)} broken links, "
      f"{sum(len(v) for v in tests.values())} tests, {len(missing)} cited tests missing")
sys.exit(1 if bad or missing else 0)
