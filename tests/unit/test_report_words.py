"""The words a report leads with (issue #46, items 11, 12, 15): the verdict box's one sentence
for each kind of verdict, the layers ranked once, plain words before a statistic, the terms
explained; and the `code` a document's texts carry, read into spans. On hand-made documents
(tests/test_report.py reads the same off real runs)."""

from __future__ import annotations

from typing import Any

from ckptforensics.report.blocks import Code, html_text, inline, md_text
from ckptforensics.report.words import explain, headline, how_far, layers_text, rel, run_dir
from tests.unit.test_report_render import _doc


def _verdict(doc: dict[str, Any], cause: str, **fields: Any) -> dict[str, Any]:
    doc["verdict"].update({"causes": [{"cause": cause, "confidence": 0.9}], **fields})
    return doc


def test_inline_reads_backticks_as_code_and_leaves_an_odd_one() -> None:
    assert inline("run `ckptforensics bisect` next") == [
        "run ",
        Code("ckptforensics bisect"),
        " next",
    ]
    assert inline("a `b`") == ["a ", Code("b")]
    assert inline("an odd ` one") == ["an odd ` one"]
    assert html_text(inline("`x<y` & z")) == "<code>x&lt;y</code> &amp; z"
    assert md_text(inline("`x` y")) == "`x` y"


def test_the_box_names_the_layer_the_element_or_nothing_and_the_rollback() -> None:
    doc = _verdict(
        _doc(),
        "gradient_explosion",
        first_bad_step=41,
        first_anomalous_module="h.2.mlp",
        exploding_layers=["h.2.mlp", "h.3.mlp"],
        rollback_checkpoint="run/step_30.pt",
    )
    assert md_text(headline(doc)) == (
        "Gradient explosion at step 41, first in `h.2.mlp`. Roll back to `step_30.pt`."
    )
    element = {"tensor": "h.0.w", "index": [3, 7], "before": 0.5, "after": 2.0, "kind": "bit_flip"}
    doc = _verdict(_doc(), "silent_corruption", corrupted_elements=[element])
    assert md_text(headline(doc)) == (
        "Silent corruption: `h.0.w[3, 7]` 0.5 → 2 (bit_flip). "
        "No checkpoint here is safe to roll back to: roll back further than `step_30.pt`."
    )
    assert md_text(headline(_doc())) == "No anomaly between `step_30.pt` and `step_40.pt`."


def test_paths_are_named_in_the_run_directory() -> None:
    doc = _doc()
    assert run_dir(doc) == "run"
    assert rel("run/step_30.pt", "run") == "step_30.pt"
    assert rel("elsewhere/step_30.pt", "run") == "elsewhere/step_30.pt"
    doc["incident"]["after"]["path"] = "/abs/step_40.pt"
    assert run_dir(doc) is None


def test_the_layers_are_one_ranking_the_first_leading() -> None:
    v = {"first_anomalous_module": "h.2.attn", "exploding_layers": ["h.2.ln_1", "h.2.attn"]}
    assert md_text(layers_text(v)) == "`h.2.attn` went first; then `h.2.ln_1`"
    v = {"first_anomalous_module": None, "exploding_layers": ["a", "b"]}
    assert md_text(layers_text(v)) == "`a`, `b` (furthest from its range first)"


def test_plain_words_come_before_the_statistic_and_terms_are_explained() -> None:
    assert how_far(4.265, 1.249, 7.62) == "3.4× its trend (robust z 7.6)"
    assert how_far(None, None, 9.5) == "far from its trend (robust z 9.5)"
    said = explain("r_v", "log Z", "nothing else")
    assert said.startswith("r_v: the gradient energy") and "log Z: the log of" in said
    assert "RMS_t" not in said and said.endswith(".")
    assert explain("loss", "grad norm") == ""
    said = explain("its gradient is over 100x what Adam's second moment expects (RMS_t)")
    assert said.startswith("RMS_t: the root mean square of gradient² / Adam's second moment")
