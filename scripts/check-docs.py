#!/usr/bin/env python3
"""Every relative link in the project's markdown points at a file that exists, and no
file cites documents outside the project. Exits 1 naming each broken link."""
import os
import re
import subprocess
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
files = subprocess.run(["git", "ls-files", "*.md"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
bad = []
for f in files:
    text = open(os.path.join(root, f), encoding="utf-8").read()
    # Links outside code spans and fences.
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^(https?:|mailto:|#)", target):
            continue
        path = os.path.normpath(os.path.join(root, os.path.dirname(f), target.split("#")[0]))
        if not os.path.exists(path):
            bad.append(f"{f}: link to {target} (no such file)")
    if "../shared" in text:
        bad.append(f"{f}: cites ../shared, which is not part of the project")
for b in bad:
    print(b)
print(f"check-docs: {len(files)} markdown files, {len(bad)} broken links")
sys.exit(1 if bad else 0)
