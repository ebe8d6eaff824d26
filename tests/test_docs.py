"""Every example in README.md and docs/*.md runs as the document shows it.

Fenced blocks: the info string says what a block is. `python`, `bash` and `yaml` are examples
and run; `text` is shown, never run (outputs, trees, diagrams, data rows). Every fence has one
(`test_every_fence_has_an_info_string`).

A document's examples run in order in one fresh directory, as a reader following it would:
`configs/`, `launch/` and `scripts/` there are the repository's (`configs/` a folder of links,
so an example may be given a file beside them), the virtual environment's bin is first on
PATH, and the suite's XLA flags (8 fake CPU devices, conftest.COMPILE_FLAGS) and compilation
cache reach every process. A bash block runs with `bash -euo pipefail`; the python blocks of a
document run in one interpreter, one namespace, in order (like a doctest session).

What an example needs that the suite cannot run, or what stands in for it, is an HTML comment
on the line just before the fence (invisible when the Markdown is rendered), one or more
directives separated by `;`:

    <!-- example: needs WHAT -->
        Not run: it needs WHAT (a TPU pod slice, a Slurm cluster, an 8B checkpoint, hours),
        which the text around it says. The suite checks what it can cheaply: every
        `jaxrl-scale ...` line parses with the CLI's parser and every config it names loads
        with its --set overrides; a `launch/...` line (or `sbatch launch/...`) runs with
        --dry-run and the train commands it prints are checked the same way; python compiles;
        yaml parses.
    <!-- example: files NAME=PATH [NAME=PATH ...] -->
        Before the block, PATH (a file or folder of the repository) is copied to NAME in the
        example's directory, replacing what is there: the tiny stand-ins for what the doc
        names (`path/to/Qwen2.5-0.5B-Instruct` is a tiny HF fixture, `runs/cispo` a run long
        enough to fit, `problems.jsonl` a data file; those made for the docs are in
        tests/fixtures/docs/).
    <!-- example: steps N -->
        `jaxrl-scale train|demo|sweep` commands, and launchers' (`launch/... -- TRAIN_ARGS`),
        get `--set train.steps=N` and the SHRINK overrides below appended: the runs the docs
        show take minutes, the suite has seconds. In a python block, `jaxrl_scale.load_config`
        appends them while the block runs.
    <!-- example: set KEY=VALUE [KEY=VALUE ...] -->
        More overrides for those commands, where the doc's config has an accelerator's shapes
        (the 0.5B recipe's 2,048-token budget) and the text says so.
    <!-- example: file NAME -->
        The block is the file NAME (written into the directory, not run): a module or a config
        that later examples use.
    <!-- example: config BASE -->
        A yaml block that is part of a config: loaded with load_config on top of BASE (a file
        `base: BASE` followed by the block).
    <!-- example: same as FILE -->
        The block is the same as one in FILE (checked), which runs it.
"""

from __future__ import annotations

import glob
import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = ("python", "bash", "yaml")
SHOWN = ("text",)
LINKED = ("launch", "scripts")
# What `steps N` adds to a training command besides train.steps=N (and warm_start.steps=N where
# the config has more): small batches, and a small held-out evaluation after every step (the
# shipped configs train on 64 prompts x 16 a step and evaluate 256-512 prompts x 4; `demo` fits
# the curve of >= 4 evaluations).
SHRINK = [
    "train.prompts_per_step=8",
    "train.group_size=4",
    "train.micro_batches=1",
    "task.num_eval=8",
    "train.eval_samples=2",
    "train.eval_every=1",
]
TIMEOUT = 300  # seconds for one block
FENCE = re.compile(r"^```(.*)$")
DIRECTIVE = re.compile(r"^<!-- example: (.*) -->$")
KNOWN = ("needs", "files", "steps", "set", "file", "config", "same")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # the first line of the code, 1-based
    lang: str
    code: str
    directives: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def parse_directives(text: str, where: str) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, rest = part.partition(" ")
        if name == "same":
            rest = rest.removeprefix("as ").strip()
        if name not in KNOWN:
            raise ValueError(f"{where}: unknown directive {name!r} (known: {', '.join(KNOWN)})")
        if name == "files":
            rest = dict(item.split("=", 1) for item in rest.split())
        elif name == "set":
            rest = rest.split()
        elif name == "steps":
            rest = int(rest)
        out[name] = rest
    return out


def read_blocks(doc: Path) -> list[Block]:
    """Every fenced block of `doc`, unlabelled ones with lang ''."""
    lines, blocks, i = doc.read_text().splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == "```")
        where = f"{doc.relative_to(ROOT)}:{i + 1}"
        d = DIRECTIVE.match(lines[i - 1]) if i else None
        directives = parse_directives(d.group(1), where) if d else {}
        code = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(doc, i + 2, m.group(1).strip(), code, directives))
        i = end + 1
    return blocks


def logical_lines(code: str) -> list[str]:
    """Shell lines with their continuations joined, comment-only and blank lines left out."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [ln for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def command_words(line: str) -> list[str]:
    """The words of a shell line, its leading VAR=value assignments and comment left out."""
    words = shlex.split(line, comments=True)
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        words.pop(0)
    return words


# ---- the example's directory and environment ----------------------------------------------


def make_workdir(path: Path) -> Path:
    (path / "configs").mkdir()
    for entry in (ROOT / "configs").iterdir():
        (path / "configs" / entry.name).symlink_to(entry)
    for name in LINKED:
        (path / name).symlink_to(ROOT / name)
    return path


def example_env() -> dict:
    env = dict(os.environ)  # conftest's XLA_FLAGS and JAX_COMPILATION_CACHE_DIR among them
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)  # a doc that needs one says so
    return env


def provide(block: Block, work: Path) -> None:
    for name, source in block.directives.get("files", {}).items():
        src, dst = ROOT / source, work / name
        assert src.exists(), f"{block.where}: files {name}={source}: no such file in the repo"
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copyfile(src, dst)


# ---- what a block that is not run is checked for ------------------------------------------


def cli_configs(argv: list[str], work: Path, where: str) -> list:
    """The configs `jaxrl-scale ARGV` runs (it must parse), loaded with its overrides."""
    from jaxrl_scale.cli import _parser
    from jaxrl_scale.config import load_config

    try:
        args = _parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `jaxrl-scale {shlex.join(argv)}` does not parse")
    overrides = list(getattr(args, "overrides", []))
    if getattr(args, "init_from", None):
        overrides.append(f"model.init_from={args.init_from}")
    if getattr(args, "adapter_from", None):
        overrides.append(f"model.lora.init_from={args.adapter_from}")
    paths = [str(args.config)] if hasattr(args, "config") else []
    for pattern in map(str, getattr(args, "configs", [])):
        paths += sorted(glob.glob(str(work / pattern))) or [pattern]
    configs = []
    for path in paths:
        try:
            configs.append(
                load_config(path if path.startswith("asset:") else work / path, overrides)
            )
        except Exception as e:  # noqa: BLE001 - a ConfigError names the key; say where it is
            pytest.fail(f"{where}: `jaxrl-scale {shlex.join(argv)}`: {type(e).__name__}: {e}")
    return configs


def cli_lines(text: str) -> list[list[str]]:
    """The `jaxrl-scale` argument lists in a launcher's dry run, quoted remote commands too."""
    found = []
    for line in text.splitlines():
        words = shlex.split(line)
        if "jaxrl-scale" not in words:  # inside a quoted command (ssh --command "...")
            words = next((ws for w in words if "jaxrl-scale" in (ws := shlex.split(w))), [])
        if "jaxrl-scale" in words:
            found.append(words[words.index("jaxrl-scale") + 1 :])
    return found


def check_unrun(block: Block, work: Path, env: dict) -> None:
    if block.lang == "python":
        compile(block.code, block.where, "exec")
        return
    if block.lang == "yaml":
        yaml.safe_load(block.code)
        return
    for line in logical_lines(block.code):
        words = command_words(line)
        if words[:1] == ["sbatch"]:
            words = ["bash", *words[next(i for i, w in enumerate(words) if "launch/" in w) :]]
        if words[:1] == ["bash"] and len(words) > 1 and words[1].startswith("launch/"):
            words = words[1:]
        if words and words[0] == "jaxrl-scale":
            cli_configs(words[1:], work, block.where)
        elif words and words[0].startswith("launch/"):
            dry = ["--dry-run"] if "--dry-run" not in words else []
            result = subprocess.run(
                ["bash", words[0], *dry, *words[1:]],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == 0, f"{block.where}: {line}\n--dry-run: {result.stderr}"
            commands = cli_lines(result.stdout)
            assert commands, f"{block.where}: {line}\n--dry-run printed no jaxrl-scale command"
            for argv in commands:
                cli_configs(argv, work, block.where)


# ---- running blocks -----------------------------------------------------------------------

_SESSION = r"""
import json, os, sys, traceback
results = os.fdopen(int(sys.argv[1]), "w")
namespace = {"__name__": "__main__"}


def shrunk(extra, steps):
    # `jaxrl_scale.load_config` as `steps` / `set` have it: the overrides appended
    import jaxrl_scale
    import jaxrl_scale.config

    load = jaxrl_scale.config.load_config

    def load_config(path=None, overrides=()):
        cfg = load(path, [*overrides, *extra])
        if steps and cfg.warm_start.steps > steps:
            cfg = load(path, [*overrides, *extra, f"warm_start.steps={steps}"])
        return cfg

    jaxrl_scale.load_config = load_config
    return lambda: setattr(jaxrl_scale, "load_config", load)


for request in sys.stdin:
    block = json.loads(request)
    restore = shrunk(block["extra"], block["steps"]) if block["extra"] else None
    try:
        exec(compile(block["code"], block["file"], "exec"), namespace)
        ok = True
    except BaseException:
        traceback.print_exc()
        ok = False
    if restore is not None:
        restore()
    sys.stdout.flush()
    sys.stderr.flush()
    results.write(json.dumps(ok) + "\n")
    results.flush()
"""


class PythonSession:
    """One interpreter for a document's python blocks, run in the example's directory."""

    def __init__(self, work: Path, env: dict):
        self.log = open(work / ".python-session.log", "w+")  # noqa: SIM115 - closed in close()
        read, write = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SESSION, str(write)],
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            pass_fds=(write,),
            cwd=work,
            env=env,
            text=True,
        )
        os.close(write)
        self.results = os.fdopen(read)

    def run(self, block: Block) -> None:
        start = self.log.tell()
        padded = "\n" * (block.line - 1) + block.code  # tracebacks give the doc's line numbers
        steps = block.directives.get("steps")
        extra = [f"train.steps={steps}", *SHRINK] if steps else []
        extra += block.directives.get("set", [])
        request = {"code": padded, "file": str(block.doc), "extra": extra, "steps": steps}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.results], [], [], TIMEOUT)
        ok = json.loads(self.results.readline() or "false") if ready else False
        if not ok:
            self.log.seek(start)
            pytest.fail(f"{block.where} (python) failed:\n{self.log.read()[-6000:]}")
        self.log.seek(0, os.SEEK_END)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.results.close()
        self.log.close()


def shrink(block: Block, work: Path) -> str:
    """The block's code with every train / demo / sweep command (a launcher's too) given
    `--set train.steps=N`, SHRINK, and warm_start.steps=N where its config has more."""
    steps, out = block.directives.get("steps"), []
    for line in re.sub(r"\\\n\s*", " ", block.code).splitlines():
        words = command_words(line) if line.strip() and not line.lstrip().startswith("#") else []
        if words[:1] == ["jaxrl-scale"] and words[1:2] in (["train"], ["demo"], ["sweep"]):
            argv = words[1:]
        elif words[:1] and words[0].startswith("launch/") and "--" in words:
            argv = ["train", *words[words.index("--") + 1 :]]
        else:
            out.append(line)
            continue
        extra = [f"train.steps={steps}", *SHRINK] if steps else []
        extra += block.directives.get("set", [])
        if steps and any(c.warm_start.steps > steps for c in cli_configs(argv, work, block.where)):
            extra.append(f"warm_start.steps={steps}")
        out.append(re.sub(r"\s+#.*$", "", line) + "".join(f" --set {s}" for s in extra))
    return "\n".join(out) + "\n"


def run_bash(block: Block, work: Path, env: dict) -> None:
    code = block.code
    if "steps" in block.directives or "set" in block.directives:
        code = shrink(block, work)
    start = time.monotonic()
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    output = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, (
        f"{block.where} (bash) exited {result.returncode} after "
        f"{time.monotonic() - start:.0f} s:\n{code}\n{output}"
    )


def run_yaml(block: Block, work: Path) -> None:
    from jaxrl_scale.config import load_config

    base = block.directives.get("config")
    assert base, f"{block.where}: a yaml block needs `file NAME`, `config BASE` or `needs`"
    fragment = work / ".example.yaml"
    fragment.write_text(f"base: {base}\n{block.code}")
    try:
        load_config(fragment)
    except Exception as e:  # noqa: BLE001 - reported with the block's place
        pytest.fail(f"{block.where}: on top of {base}: {type(e).__name__}: {e}")


def run_document(doc: Path, work: Path) -> None:
    env, session = example_env(), None
    try:
        for block in read_blocks(doc):
            if block.lang not in RUN:
                continue
            d = block.directives
            if "same" in d:
                others = read_blocks(ROOT / d["same"])
                assert any(o.code == block.code and o.lang == block.lang for o in others), (
                    f"{block.where}: not the same as any block of {d['same']}"
                )
                continue
            provide(block, work)
            if "needs" in d:
                check_unrun(block, work, env)
            elif "file" in d:
                (work / d["file"]).parent.mkdir(parents=True, exist_ok=True)
                (work / d["file"]).write_text(block.code)
            elif block.lang == "yaml":
                run_yaml(block, work)
            elif block.lang == "bash":
                run_bash(block, work, env)
            else:
                session = session or PythonSession(work, env)
                session.run(block)
    finally:
        if session is not None:
            session.close()


# ---- the tests ----------------------------------------------------------------------------


def test_every_fence_has_an_info_string():
    bare = [b.where for doc in DOCS for b in read_blocks(doc) if not b.lang]
    assert not bare, f"fences without an info string (python, bash, yaml, or text): {bare}"
    odd = [
        f"{b.where} ({b.lang})" for doc in DOCS for b in read_blocks(doc)
        if b.lang not in RUN + SHOWN
    ]  # fmt: skip
    assert not odd, f"info strings the suite does not know: {odd}"


def test_directives_sit_on_examples():
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("<!-- example:"):
                assert DIRECTIVE.match(line), f"{doc.name}:{i + 1}: not `<!-- example: ... -->`"
                assert FENCE.match(lines[i + 1]), f"{doc.name}:{i + 1}: no fence right after"
        for b in read_blocks(doc):
            assert not b.directives or b.lang in RUN, f"{b.where}: a directive on a {b.lang!r}"
            if b.lang == "yaml" and not b.directives:
                pytest.fail(f"{b.where}: a yaml block needs `file NAME`, `config BASE` or needs")


@pytest.mark.parametrize(
    "doc",
    [d for d in DOCS if re.search(r"^```(python|bash|yaml)$", d.read_text(), re.M)],
    ids=lambda d: d.name,
)
def test_examples_run(doc, tmp_path):
    run_document(doc, make_workdir(tmp_path))
