#!/usr/bin/env python3
"""Every relative link in the project's markdown points at a file that exists (and, with
`#anchor`, at a heading of that file), and no file cites documents outside the project.
Exits 1 naming each broken link."""
import os
import re
import subprocess
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
files = subprocess.run(["git", "ls-files", "*.md"], cwd=root, capture_output=True, text=True, check=True).stdout.split()


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
for b in bad:
    print(b)
print(f"check-docs: {len(files)} markdown files, {len(bad)} broken links")
sys.exit(1 if bad else 0)
