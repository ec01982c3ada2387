"""The examples in README.md and docs/*.md run, or say why not and which test covers them, so none can rot.

Every fenced code block is one of:

- ```python: executed, each block with a fresh namespace in its own empty folder (one interpreter for all of
  them: importing torch once instead of once per block keeps this file fast);
- ```bash: executed with ``bash -e`` in a folder under tmp_path holding a copy of ``configs/`` (so relative
  paths resolve and every output lands in tmp_path, never in the repository), with this interpreter first on
  PATH (``python -m lightning_mlopt`` forked from the preloaded server: the same entry point, imports paid
  once); it must exit 0;
- ```yaml: parsed with ``yaml.safe_load``; preceded by ``<!-- file: NAME -->`` it is also written as NAME
  into the folder of that page's bash blocks (the sweep file a command names);
- ```text: output or a folder layout, not a command.

A python or bash block that cannot run here or is too slow for the suite (a GPU, several nodes, a cluster, a
fit of a minute) is preceded by ``<!-- not-run: REASON; covered by tests/test_x.py::test_y -->``, and every
file and test function it names must exist. Any other block (no language, another language) fails: nothing
is skipped silently.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import CONFIGS, REPO, REPO_PYTHONPATH
from tests.support.preloaded import SERVER_ENV, server_socket
from tests.support.preloaded_client import python_shim

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN = {"python", "bash"}
DATA = {"text", "yaml"}

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>[\w-]+):\s*(?P<text>.*?)\s*-->\s*$")
_COVERED = re.compile(r"(?P<reason>[^;]+);\s*covered by\s+(?P<refs>.+)")
_REF = re.compile(r"[\w.-]*/[\w./-]*[\w-](?:::\w+)?")  # a repository path with a slash, maybe ::test_name


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # "not-run" or "file", from an HTML comment on the line right before the fence
    marker_text: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, start = opening["indent"], i
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        assert i < len(lines), f"{page.relative_to(REPO)}:{start + 1}: a code block is never closed"
        code = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in lines[start + 1 : i])
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(before)
        blocks.append(
            Block(
                page,
                start + 1,
                opening["lang"],
                code + "\n",
                marker["kind"] if marker else None,
                marker["text"] if marker else "",
            )
        )
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in _blocks(page)]
RUNNABLE = [b for b in BLOCKS if b.lang in RUN and b.marker != "not-run"]
PYTHON = [b for b in RUNNABLE if b.lang == "python"]
BASH = [b for b in RUNNABLE if b.lang == "bash"]


def _ids(blocks: list[Block]) -> list[str]:
    return [b.id for b in blocks]


def test_the_blocks_are_found():
    # Guards against a parser or a glob that silently finds nothing (and a test that checks nothing).
    assert len(PAGES) >= 10, PAGES
    assert len(PYTHON) >= 5 and len(BASH) >= 5, _ids(RUNNABLE)
    assert any(b.marker == "not-run" for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=_ids(BLOCKS))
def test_every_block_runs_or_says_why_not(block: Block):
    assert block.lang in RUN | DATA, (
        f"{block.id}: a ```{block.lang} block; tag it python or bash (it runs, or carries a not-run marker), "
        "or text or yaml (not a command)"
    )
    if block.marker == "not-run":
        assert block.lang in RUN, f"{block.id}: only python and bash blocks take a not-run marker"
        covered = _COVERED.fullmatch(block.marker_text)
        assert covered and covered["reason"].strip(), (
            f"{block.id}: write <!-- not-run: REASON; covered by tests/test_x.py::test_y -->, got {block.marker_text!r}"
        )
        refs = _REF.findall(covered["refs"])
        assert refs, f"{block.id}: the not-run marker names no covering test: {block.marker_text!r}"
        for ref in refs:
            path, _, name = ref.partition("::")
            assert (REPO / path).is_file(), f"{block.id}: the covering file {path} does not exist"
            if name:
                source = (REPO / path).read_text()
                assert re.search(rf"^(async )?def {name}\(", source, re.M), f"{block.id}: no test {name} in {path}"
    elif block.marker == "file":
        assert block.lang in DATA and re.fullmatch(r"[\w.-]+", block.marker_text), f"{block.id}: bad file marker"
    else:
        assert block.marker is None, f"{block.id}: unknown marker {block.marker!r} (not-run or file)"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "yaml"], ids=lambda b: b.id)
def test_yaml_blocks_parse(block: Block):
    assert isinstance(yaml.safe_load(block.code), dict), block.id


def test_the_readme_install_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    ci_command = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command in readme.splitlines(), "the README's second command and .ci/run differ"


_PYTHON_DRIVER = textwrap.dedent(
    """
    import json, os, sys, traceback
    jobs = json.load(open(sys.argv[1]))
    results = {}
    for job in jobs:
        os.chdir(job["dir"])
        try:
            exec(compile(job["code"], job["id"], "exec"), {"__name__": "__main__"})
            results[job["id"]] = None
        except BaseException:
            results[job["id"]] = traceback.format_exc()
    json.dump(results, open(sys.argv[2], "w"))
    """
)


@pytest.fixture(scope="module")
def python_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str | None], str]:
    """Run every python block once, in one interpreter; each block's traceback (None: it ran), and the output."""
    root = tmp_path_factory.mktemp("python_blocks")
    jobs = []
    for n, block in enumerate(PYTHON):
        folder = root / f"block-{n}"
        folder.mkdir()
        jobs.append({"id": block.id, "code": block.code, "dir": str(folder)})
    (root / "jobs.json").write_text(json.dumps(jobs))
    result = subprocess.run(
        [sys.executable, "-c", _PYTHON_DRIVER, str(root / "jobs.json"), str(root / "results.json")],
        cwd=root,
        env={**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0 and (root / "results.json").is_file(), output
    return json.loads((root / "results.json").read_text()), output


@pytest.mark.parametrize("block", PYTHON, ids=_ids(PYTHON))
@pytest.mark.slow
def test_python_block_runs(block: Block, python_results: tuple[dict[str, str | None], str]):
    results, output = python_results
    assert results[block.id] is None, f"{block.id} raised:\n{results[block.id]}\n--- output ---\n{output}"


@pytest.mark.parametrize("block", BASH, ids=_ids(BASH))
@pytest.mark.slow
def test_bash_block_runs(block: Block, tmp_path: Path):
    shutil.copytree(CONFIGS, tmp_path / "configs")
    for other in BLOCKS:
        if other.page == block.page and other.marker == "file":
            (tmp_path / other.marker_text).write_text(other.code)
    # `python` in a block is this interpreter; `python -m lightning_mlopt ...` runs the CLI's entry point forked from
    # the preloaded server (tests/support/preloaded_client.py): the same command, without its seconds of imports.
    shim = python_shim(tmp_path / ".bin")
    path = os.pathsep.join([str(shim), str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {**os.environ, "PATH": path, "PYTHONPATH": REPO_PYTHONPATH, SERVER_ENV: str(server_socket())}
    env.pop("MASTER_PORT", None)
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, f"{block.id} exited {result.returncode}:\n{(result.stdout + result.stderr)[-3000:]}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
