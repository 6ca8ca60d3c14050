"""Benchmarks write their tables into docs/benchmarks.md, each owning one `## ` section."""
import os

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks.md")


def write_section(title: str, body: str, path: str = DOC) -> None:
    """Replaces the section `## title` (up to the next `## `) or appends it."""
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    lines, out, skipping = text.splitlines(), [], False
    for line in lines:
        if line.startswith("## "):
            skipping = line[3:].strip() == title
            if skipping:
                continue
        if not skipping:
            out.append(line)
    while out and not out[-1].strip():  # the removed section's blank lines would pile up on each rewrite
        out.pop()
    out += ["", f"## {title}", "", body.strip(), ""]
    with open(path, "w") as f:
        f.write("\n".join(out).rstrip() + "\n")
