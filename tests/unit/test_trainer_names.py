"""Outside `trainers/`, a trainer's name appears in code only in the registry (issue #43): a new
trainer is one folder and one registry line. The package's AST outside `trainers/` is walked
for string constants (docstrings aside: prose may cite a trainer), names, attributes,
definitions, arguments and imports that name a trainer; what is left is listed per file below,
and its count can only shrink."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ckptforensics.trainers import PLANNERS

PACKAGE = Path(__file__).resolve().parents[2] / "ckptforensics"

# The trainers' names as code spells them (case aside): each registry module's, OLMo-core's
# stem, and LitGPT (a plain loop's, `trainers/loop`). `hf` only as a word of its own.
TRAINER = re.compile(
    r"megatron|olmo|deepspeed|lightning|torchtitan|nanogpt|litgpt|(?<![a-z])hf(?![a-z])",
    re.IGNORECASE,
)

# What is left, per file (path under ckptforensics/): the count of occurrences, which may only
# go down (lower it here when you remove one). Nothing under logs/ or formats/.
ALLOWED: dict[str, int] = {
    # Help text (what --model, --data, --collator, --labels, --tokenizer and --metrics take from
    # each trainer): the CLI cannot ask the registry for it, which imports torch (`--help` must not).
    "cli/params.py": 4,
    "cli/replays.py": 1,
    "cli/runs.py": 2,
    # Rule ids named after the rule's source (`megatron-10x`, `lightning-rtol`: report output and
    # docs/signatures.md) and messages citing it ("Megatron's spiky-loss rule", "Megatron's
    # count"): the detectors' knowledge of what went wrong, not of what a run is.
    "detectors/log/short.py": 5,
    "detectors/log/signals.py": 2,
    # Findings' sources and actions citing a threshold's origin ("OLMo-core 6 sigma") or a
    # trainer's setting ("OLMo-core's z_loss_multiplier").
    "detectors/audit/architecture.py": 2,
    "detectors/audit/headroom.py": 1,
    "detectors/audit/numerics.py": 1,
    "detectors/audit/observability.py": 2,
    "detectors/audit/optimizer.py": 2,
    "detectors/diff/magnitude.py": 1,
    "detectors/replay/examine.py": 1,
    "detectors/replay/rows.py": 1,
    # The resume causes' actions, in each trainer's terms.
    "detectors/causes.py": 4,
    # engine/: the replay window's messages. audit asks `trainers.settings` for the run's
    # settings; the replay, whatif and the diff import what one trainer implements from the
    # registry (`config_model`, `require_rebuilt_match`, the SkipStep functions), and cite a
    # trainer's convention through it (`convention_of`).
    "engine/bisect.py": 1,
    "engine/replay/window.py": 3,
    # Nothing under formats/: each trainer's checkpoint.py registers its torch.save flavour
    # (`formats.torchsave.register_flavour`), the classes it pickles
    # (`formats.inert.register_safe_globals`), its records beside DCP files
    # (`formats.dcp.register_dcp_records`), HF's decay groups (`formats.optstate.register_group_rule`).
    # optim/: the libraries that implement a family (transformers' Adafactor, DeepSpeed's and
    # apex's Adam and LAMB): an optimizer's own implementations, not a trainer's knowledge.
    "optim/adafactor.py": 6,
    "optim/adam.py": 1,
    "optim/lamb.py": 2,
    # record/: the flight recorder's callbacks for the HF Trainer and Lightning.
    "record/hf.py": 2,
    "record/lightning.py": 3,
}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _text(node: ast.AST) -> str | None:
    """What a node spells: a string constant, a name, an attribute, a definition's, argument's
    or keyword's name, an import's module and names."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.arg):
        return node.arg
    if isinstance(node, ast.keyword):
        return node.arg
    if isinstance(node, ast.alias):
        return f"{node.name} {node.asname or ''}"
    if isinstance(node, ast.ImportFrom):
        return node.module
    return None


def occurrences(source: str) -> list[tuple[int, str]]:
    """(line, text) of every node of `source` that names a trainer, docstrings aside."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        text = None if id(node) in docs else _text(node)
        if text and TRAINER.search(text):
            found.append((getattr(node, "lineno", 0), text))
    return sorted(found)


def _outside_trainers() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("trainers/"):
            continue
        found = occurrences(path.read_text(encoding="utf-8"))
        if found:
            out[rel] = found
    return out


def test_trainer_names_outside_trainers_only_where_allowed() -> None:
    found = _outside_trainers()
    grown = {
        rel: [f"{line}: {text[:80]!r}" for line, text in hits]
        for rel, hits in found.items()
        if len(hits) > ALLOWED.get(rel, 0)
    }
    assert not grown, f"trainer names outside trainers/ (ask the registry instead): {grown}"
    shrunk = {
        rel: (len(found.get(rel, [])), n)
        for rel, n in ALLOWED.items()
        if len(found.get(rel, [])) < n
    }
    assert not shrunk, f"fewer trainer names than allowed (found, allowed): lower ALLOWED: {shrunk}"


def test_the_pattern_finds_every_registered_trainer() -> None:
    """A new trainer's name is looked for too (the plain loop's, a common word, aside)."""
    assert all(TRAINER.search(name) for name in PLANNERS if name != "loop")


def test_the_walk_skips_docstrings_and_finds_code() -> None:
    src = '"""Megatron-LM\'s log."""\nX = "hf"\ndef f(lightning_dir):\n    """OLMo."""\n    return a.megatron_lr\n'
    assert [t for _, t in occurrences(src)] == ["hf", "lightning_dir", "megatron_lr"]
