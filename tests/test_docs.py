"""The README and docs/ say what ships: the generated configuration reference is current, every
default named in prose (`section.field: value` in backticks) is the one configs/default.yaml
ships, the README stays short, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from clawflow.config import REPO_ROOT, load_config
from clawflow.config import reference

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 250

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# `train.kl_beta: 0.5`: a dotted config name, a colon, a value: the form the docs give a shipped default in
DEFAULT = re.compile(r"(?<!`)`([a-z_]+(?:\.[a-z0-9_]+)+): ([^`\n]+)`(?!`)")
# `train.nproc=8`: a value to set instead of the shipped one; the name must still be a config field
SETTING = re.compile(r"(?<!`)`([a-z_]+(?:\.[a-z0-9_]+)+)=[^`\n]+`")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """Text outside fenced code blocks (those hold examples, not defaults)."""
    return FENCE.sub("", text)


def named_defaults(text: str) -> list[tuple[str, str]]:
    return DEFAULT.findall(prose(text))


def shipped_value(cfg, dotted: str):
    """The loaded config's value at `dotted`, or KeyError when no config field has that name."""
    value = cfg
    for part in dotted.split("."):
        if not isinstance(value, BaseModel) or part not in type(value).model_fields:
            raise KeyError(dotted)
        value = getattr(value, part)
    return value


def mismatches(text: str, cfg) -> list[str]:
    """Each `name: value` of `text` that names no config field or differs from `cfg`."""
    out = []
    for name, written in named_defaults(text):
        try:
            actual = reference.plain(shipped_value(cfg, name))
        except KeyError:
            out.append(f"`{name}: {written}`: no such config field")
            continue
        try:
            said = yaml.safe_load(written)
        except yaml.YAMLError:
            out.append(f"`{name}: {written}`: the value is not YAML")
            continue
        if isinstance(actual, str):  # `train.autocast: off` names the string "off", not YAML's false
            same = written.strip().strip("'\"") == actual
        elif isinstance(said, dict) and isinstance(actual, dict):  # `train.lora: {r: 16, alpha: 32}`
            same = all(actual.get(k) == v for k, v in said.items())
        elif isinstance(said, (int, float)) and not isinstance(said, bool) and isinstance(actual, (int, float)):
            same = float(said) == float(actual)
        else:
            same = said == actual
        if not same:
            out.append(f"`{name}: {written}` but configs/default.yaml ships {reference._flow(actual)}")
    for name in SETTING.findall(prose(text)):
        try:
            shipped_value(cfg, name)
        except KeyError:
            out.append(f"`{name}=…`: no such config field")
    return out


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    for var in ("CLAWFLOW_HOME", "CLAWFLOW_CONFIG", "CLAWFLOW_API_KEY", "CLAWFLOW_ADMIN_KEY"):
        mp.delenv(var, raising=False)
    try:
        yield load_config(REPO_ROOT / "configs" / "default.yaml")
    finally:
        mp.undo()


def test_configuration_reference_is_generated():
    page = reference.PAGE
    assert page.is_file(), "docs/configuration.md is missing: run `python -m clawflow.config.reference --write`"
    assert page.read_text() == reference.render(), (
        "docs/configuration.md differs from the config models: run `python -m clawflow.config.reference --write`")


def test_reference_lists_every_field_with_its_shipped_default(shipped):
    text = reference.render()

    def walk(cls, prefix):
        for name, info in cls.model_fields.items():
            yield f"{prefix}{name}"
            nested = reference._model_in(info.annotation)
            if nested is not None:
                yield from walk(nested, f"{prefix}{name}.")

    for dotted in walk(type(shipped), ""):
        if dotted.startswith("judge.embedded.reader."):
            continue  # a model section: rendered once, under `model`
        section = "." not in dotted and reference._model_in(type(shipped).model_fields[dotted].annotation)
        assert (f"\n## {dotted}\n" if section else f"| `{dotted}` |") in text, dotted
    row = next(line for line in text.splitlines() if line.startswith("| `train.kl_beta` |"))
    assert "`0.5` (class: `0.0`)" in row, row  # the shipped value, then the class default it overrides
    row = next(line for line in text.splitlines() if line.startswith("| `train.objective` |"))
    assert "`distill` (class: `combined`)" in row, row


def test_defaults_named_in_prose_are_the_shipped_ones(shipped):
    found, wrong = 0, []
    for page in PAGES:
        text = page.read_text()
        found += len(named_defaults(text))
        wrong += [f"{page.relative_to(REPO_ROOT)}: {m}" for m in mismatches(text, shipped)]
    assert not wrong, "\n".join(wrong)
    assert found >= 20, f"only {found} defaults named as `section.field: value`: the check reads nothing"


def test_the_prose_check_catches_a_wrong_default(shipped):
    text = ("RL by default: `train.objective: rl`, with `train.kl_beta: 0` and `gate.max_kl: 0.25`; "
            "`train.lora: {r: 8}`, `train.no_such_field: 1`, `train.nprocs=8`; right: `train.rewrite_samples: 4`, "
            "`store.fsync: group`, `gate.helpfulness.margin: 0.03`, `train.autocast: off`, `train.nproc=8`."
            "\n```yaml\n`train.lr: 1`\n```\n")
    out = mismatches(text, shipped)
    assert len(out) == 6, out
    assert any("train.objective" in m and "ships distill" in m for m in out), out
    assert any("no such config field" in m for m in out), out


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_readme_gives_the_ci_test_command():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M), ".ci/run no longer runs `make test`"
    assert re.search(r"^make test ", README.read_text(), re.M), "README.md must give `make test`, the command CI runs"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids of a Markdown page."""
    out = set()
    for line in prose(page.read_text()).splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def broken_links(page: Path) -> list[str]:
    out = []
    for a, b in LINK.findall(prose(page.read_text())):
        target = a or b
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            out.append(f"{target}: no heading #{anchor} in {dest.name}")
    return out


def test_relative_links_resolve():
    bad = [f"{p.relative_to(REPO_ROOT)}: {m}" for p in PAGES for m in broken_links(p)]
    assert not bad, "\n".join(bad)
    assert sum(len(LINK.findall(p.read_text())) for p in PAGES) >= 10


def test_the_link_check_catches_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text("[ok](there.md) [ok](there.md#a-heading) [web](https://example.com) [gone](missing.md) "
                    "[anchor](there.md#nope) ![img](shots/x.png)\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "there.md#nope: no heading #nope in there.md",
                                  "shots/x.png: no such file"]
