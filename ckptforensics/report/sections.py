"""A diagnosis report as one list of sections: what report.md and report.html both render.

The verdict's facts, its tables and actions, the resume plan, then each engine's details
(findings, the checkpoint pair and per-tensor diff, the replay, the bisection, the what-if),
built once as blocks from the report document. The renderers add only what a format alone
has: report.md's title line and footer, report.html's page shell and plots.
"""

from __future__ import annotations

from typing import Any

from ckptforensics.report.blocks import (
    Block,
    Bullets,
    Code,
    Facts,
    Item,
    Para,
    Section,
    Spans,
    Steps,
    Table,
    Text,
    inline,
)
from ckptforensics.report.history import history_sections
from ckptforensics.report.plan import plan_blocks
from ckptforensics.report.regress import regress_sections
from ckptforensics.report.text import finite, fmt, reproduces
from ckptforensics.report.words import explain, layers_text, rel, run_dir

__all__ = ["title", "report_sections", "detail_sections"]


def title(doc: dict[str, Any]) -> str:
    """The report's title: the leading cause, a plan's or a what-if's."""
    top = doc["verdict"]["causes"][0]["cause"].replace("_", " ")
    if doc.get("whatif") and doc.get("replay"):  # the `plan` command's report
        return f"plan — {top}"
    return "what-if" if doc.get("whatif") else top


def _ckpt(c: dict[str, Any], root: str | None) -> Text:
    return [Code(rel(c["path"], root)), f" (step {fmt(c['step'])}, {c['format']})"]


def _facts(doc: dict[str, Any]) -> Facts:
    """The verdict's key facts, checkpoints relative to the run directory named once."""
    v, inc = doc["verdict"], doc["incident"]
    root = run_dir(doc)
    rows: list[tuple[str, Text]] = [("Run directory", [Code(root)])] if root else []
    rows.append(("Before", _ckpt(inc["before"], root)))
    if doc.get("whatif") and not doc.get("replay"):
        # A what-if replays forward from *before*: there is no *after* and no diagnosis.
        w = doc["whatif"]
        n = len(w["outcomes"][0]["steps"]) if w["outcomes"] else 0
        rows.append(("Replayed", [f"{n} steps per mitigation, {len(w['outcomes'])} runs"]))
    elif doc.get("regress"):  # one state stepped under two versions of the code
        reg = doc["regress"]
        rows += [("Stepped", [f"steps {', '.join(str(s['step']) for s in reg['steps'])}: side A twice, side B once"]),
                 ("Status", [reg["status"]])]  # fmt: skip
    else:
        rollback = v["rollback_checkpoint"]
        rows += [
            ("After", _ckpt(inc["after"], root)),
            ("Causes", [", ".join(f"{c['cause'].replace('_', ' ')} {c['confidence']:.0%}" for c in v["causes"])]),
            ("Reproduces", [reproduces(v)]),
            ("Rollback checkpoint", [Code(rel(rollback, root))] if rollback else ["—"]),
        ]  # fmt: skip
    if v.get("replay_check"):
        rows.append(("Replay vs the run's log", inline(v["replay_check"]["reason"])))
    if v["first_bad_step"] is not None:
        rows.append(("First bad step", [fmt(v["first_bad_step"])]))
    if v["first_anomalous_module"] or v["exploding_layers"]:
        rows.append(("Layers", layers_text(v)))
    return Facts(rows)


def _samples(v: dict[str, Any], key: str = "anomalous_samples") -> Table:
    """The anomalous rows (or the unusual ones the spike does not need); their score only where
    it ranks them (a bisection's rows are each needed, all alike)."""
    rows = v[key][:16]
    scored = len({s["score"] for s in rows}) > 1
    head = ["row", "sample id", *(["score"] if scored else []), "why"]
    return Table(
        head,
        [
            [s["index"], fmt(s["sample_id"]), *([fmt(s["score"])] if scored else []), s["why"]]
            for s in rows
        ],
        note=explain(*(s["why"] for s in rows)),
    )


def _verdict_sections(v: dict[str, Any]) -> list[Section]:
    """The verdict's tables (corrupted elements, anomalous samples, tensors at their limit)
    and its recommended actions."""
    out = [
        Section("Corrupted elements", [Table(
            ["tensor", "where", "index", "before", "after", "kind"],
            [[Code(e["tensor"]), e["where"], e["index"], fmt(e["before"]), fmt(e["after"]), e["kind"]]
             for e in v["corrupted_elements"][:10]],
        )] if v["corrupted_elements"] else []),
        Section("Anomalous samples", [_samples(v)] if v["anomalous_samples"] else []),
        Section(
            "Also unusual (the spike does not need them)",
            [_samples(v, "unusual_samples")] if v.get("unusual_samples") else [],
        ),
        Section("Tensors at their dtype's limit", [Table(
            ["tensor", "where", "dtype", "max abs", "limit"],
            [[Code(o["name"]), o["where"], o["dtype"], fmt(o["max_abs"]), fmt(o["limit"])]
             for o in v["overflowing_tensors"][:10]],
        )] if v["overflowing_tensors"] else []),
    ]  # fmt: skip
    acts = [Item(i, inline(a)) for i, a in enumerate(v["recommended_actions"], 1)]
    out.append(Section("Recommended actions", [Steps(acts)] if acts else []))
    return out


def _findings(findings: list[dict[str, Any]]) -> Section:
    """Every finding, collapsed; what its statistics mean under the table."""
    if not findings:
        return Section(f"Findings ({len(findings)})", [Para(["No findings."])], collapsed=True)
    rows = [[f["id"], f["severity"], f["kind"], Code(f["subject"]), fmt(f["score"]), Spans(inline(f["message"]))]
            for f in findings]  # fmt: skip
    note = explain(*(f["message"] for f in findings))
    table = Table(["id", "severity", "kind", "subject", "score", "message"], rows, note=note)
    return Section(f"Findings ({len(findings)})", [table], collapsed=True)


_TENSOR_HEAD = ["tensor", "dtype", "update/weight per step", "max abs Δ", "r_v", "sign-like share",
                "bound violations", "non-finite"]  # fmt: skip


def _diff(diff: dict[str, Any]) -> list[Section]:
    """The checkpoint pair and the per-tensor diff, collapsed; the largest movers first."""
    p = diff["pair"]
    pair: list[Block] = [
        Table(
            ["", "before", "after"],
            [
                ["trainer step", fmt(p["step_a"]), fmt(p["step_b"])],
                ["optimizer step", fmt(p["adam_step_a"]), fmt(p["adam_step_b"])],
                ["loss scale", fmt(p["loss_scale_a"]), fmt(p["loss_scale_b"])],
                ["LR per group", ", ".join(fmt(x) for x in p["lr_a"]) or "—",
                 ", ".join(fmt(x) for x in p["lr_b"]) or "—"],
            ],
        ),
        Para([f"Optimizer: {p['optimizer'] or 'none (weights only)'}; betas {p['betas'] or '—'}."]),
    ]  # fmt: skip
    if p.get("notes"):
        pair.append(Bullets([[n] for n in p["notes"]], tight=True))
    rows = sorted(diff["tensors"], key=lambda t: -(t["update_ratio"] or 0))
    table = Table(
        _TENSOR_HEAD,
        [[Code(t["name"]), t["dtype"], fmt(t["update_ratio"]), fmt(t["dw_max_abs"]), fmt(t["r_v"]),
          fmt(t["rho_share_b"]),
          t["bound_violations"] + t["vfloor_violations"] + t["mbound_violations"] + t["outlier_changes"],
          t["nonfinite_b"]] for t in rows],
        note=explain(*_TENSOR_HEAD),
    )  # fmt: skip
    return [
        Section("Checkpoint pair", pair, collapsed=True),
        Section(f"Per-tensor diff ({len(diff['tensors'])} tensors)", [table], collapsed=True),
    ]


def _config(config: dict[str, Any]) -> list[Block]:
    items: list[Text] = []
    for k, c in config.items():
        val = c["value"]
        if isinstance(val, dict) and len(val) > 4:
            val = f"{len(val)} steps"
        items.append([f"{k}: {val} ({c['source']})"])
    return [Para(["Configuration (value, source):"]), Bullets(items)]


_CHECK_HEAD = ["step", "replayed loss", "logged loss", "match", "replayed grad norm",
               "logged grad norm", "match"]  # fmt: skip


def _check_table(check: dict[str, Any]) -> Block:
    rows = [
        [c["step"], fmt(c["loss"]), fmt(c["logged_loss"]), fmt(c["loss_ok"]), fmt(c["grad_norm"]),
         fmt(c["logged_grad_norm"]), fmt(c["grad_ok"])]
        for c in check.get("steps", [])
    ]  # fmt: skip
    if not rows:
        return Para([f"No logged figure to compare ({check.get('note') or 'no log'})."])
    return Table(_CHECK_HEAD, rows)


_REPLAY_HEAD = ["step", "loss", "logged loss", "grad norm", "skipped", "loss scale",
                "max abs logit", "log Z"]  # fmt: skip


def _replay(rep: dict[str, Any]) -> Section:
    """The replay, collapsed: each step's figures, the attention logits, the configuration
    and how the replay checked out against the run's log and *after* (or why it is withheld)."""
    if rep.get("withheld"):
        blocks = [Para([rep["withheld"] + "."]), _check_table(rep.get("check") or {})]
        return Section(f"Replay (withheld, {rep['precision']})", [*blocks, *_config(rep["config"])], collapsed=True)  # fmt: skip
    logged = rep.get("logged") or {}
    blocks: list[Block] = [
        Table(
            _REPLAY_HEAD,
            [[r["step"], fmt(r["loss"]), fmt((logged.get(str(r["step"])) or {}).get("loss")), fmt(r["grad_norm"]),
              fmt(r["skipped"]), fmt(r["loss_scale"]), fmt(r["logit_absmax"]), fmt(r["log_z"])]
             for r in rep["steps"]],
            note=explain(*_REPLAY_HEAD),
        )
    ]  # fmt: skip
    if rep.get("attention"):
        blocks += _attention(rep["attention"])
    if any("dropped" in (r.get("router") or {}) for r in rep["steps"]):
        blocks += _capacity(rep["steps"])
    blocks += _config(rep["config"])
    check = rep.get("check") or {}
    if check.get("checked_steps"):
        t = check["tolerance"]
        blocks.append(Para([f"Checked against the run's log on {len(check['checked_steps'])} steps (its loss read as {check['loss_as']}; "
                            f"tolerance {t['loss_rtol']:g} relative on the loss, {t['grad_rtol']:g} on the grad norm)."]))  # fmt: skip
    if check.get("note"):
        blocks.append(Para([f"Log check: {check['note']}."]))
    r = rep.get("reproduction")
    if r:
        blocks.append(Para([f"Reproduction against after: {r['mismatched']:,} of {r['elements']:,} elements outside tolerance, "
                            f"{r['impossible']:,} beyond any Adam step."]))  # fmt: skip
    return Section(
        f"Replay ({len(rep['steps'])} steps, {rep['precision']})", blocks, collapsed=True
    )


def _attention(att: dict[str, Any]) -> list[Block]:
    """The six attention layers with the largest pre-softmax logit, per replayed step."""
    steps = sorted(att, key=int)
    mods = att[steps[0]]["modules"]

    def peak(i: int) -> float:  # JSON null: a non-finite logit (an overflow upstream)
        return max(
            (
                v
                for s in steps
                if i < len(att[s]["max_logit"]) and (v := att[s]["max_logit"][i]) is not None
            ),
            default=0.0,
        )

    top = sorted(sorted(range(len(mods)), key=lambda i: -peak(i))[:6])
    return [
        Para(["Largest pre-softmax attention logit per layer (entropy of its most collapsed head, of uniform):"]),
        Table(
            ["step", *[Code(mods[i]) for i in top]],
            [[s, *[f"{fmt(att[s]['max_logit'][i])} ({fmt(att[s]['entropy'][i])})" for i in top]] for s in steps],
        ),
    ]  # fmt: skip


def _capacity(steps: list[dict[str, Any]]) -> list[Block]:
    """The tokens each MoE layer's experts kept and those dropped past their capacity, per
    replayed step (gates that route under a capacity: the router's `GateFigures`)."""
    rows = [r for r in steps if "dropped" in (r.get("router") or {})]
    mods = rows[0]["router"]["modules"]
    return [
        Para(["Tokens each expert kept per MoE layer, and the routes dropped past the expert's capacity:"]),
        Table(
            ["step", *[Code(m) for m in mods]],
            [[r["step"], *[f"{' '.join(map(str, k))} kept; {d} of {sum(n)} dropped (capacity {c})"
                           for k, n, d, c in zip(r["router"]["tokens"], r["router"]["routed"],
                                                 r["router"]["dropped"], r["router"]["capacity"], strict=True)]]
             for r in rows],
        ),
    ]  # fmt: skip


def _bisect(bis: dict[str, Any]) -> list[Section]:
    """The bisection: first bad step, culprit rows (decoded), its trials collapsed."""
    spikes = {True: "spikes", False: "does not spike"}.get(bis["presence_spikes"], "—")
    facts: list[Text] = [
        [f"first bad step: {fmt(bis['first_bad_step'])}; culprit rows: {bis['rows'] or '—'} (sample ids {bis['sample_ids'] or '—'})"],
        [f"minimal set whose removal removes the spike: {bis['minimal_rows'] or '—'}; alone with healthy rows it {spikes}"],
        [f"evaluations: {bis['replays']} (budget {bis['budget']})" + (f"; {bis['note']}" if bis.get("note") else "")],
    ]  # fmt: skip
    if bis["disagreements"]:
        facts.append([f"replayed loss differs from the training log at steps {[d['step'] for d in bis['disagreements']]}"])  # fmt: skip
    blocks: list[Block] = [Bullets(facts)]
    if bis.get("texts"):
        blocks += [
            Para(["Culprit rows, decoded:"]),
            Table(["row", "text (first 256 tokens)"], [[r, Code(t.replace("\n", " ")[:300])] for r, t in bis["texts"].items()]),
        ]  # fmt: skip
    trials = [
        [t["label"], fmt(t["loss"]), fmt(t["grad_norm"]), fmt(t["robust_z"]), fmt(t["spiked"])]
        for t in bis["trials"]
    ]
    head = ["trial", "loss", "grad norm", "robust z", "spikes"]
    return [
        Section("Bisection", blocks),
        Section("Bisection trials", [Table(head, trials, note=explain(*head))] if trials else [], collapsed=True),
    ]  # fmt: skip


_WHATIF_HEAD = ["mitigation", "on track", "max loss", "max grad norm", "final loss",
                "overflow-skipped steps"]  # fmt: skip


def _mitigation(o: dict[str, Any], wi: dict[str, Any]) -> str:
    """A mitigation as tried, `auto` rows named by their sample ids where the bisection gave them."""
    ids = wi.get("auto_sample_ids") or {}
    if o["mitigation"] == "skip_samples=auto" and ids:
        said = "; ".join(f"{', '.join(map(str, v))} of step {k}" for k, v in ids.items())
        return f"skip_samples=auto (samples {said})"
    return o["mitigation"]


def _whatif(wi: dict[str, Any]) -> Section:
    """Each mitigation's outcome and the band it was judged against."""
    rows = [
        [_mitigation(o, wi), fmt(o["on_track"]), finite(o["max_loss"]), finite(o["max_grad_norm"]),
         finite(o["final_loss"]), ", ".join(map(str, o["skipped_updates"])) or "none"]
        for o in wi["outcomes"]
    ]  # fmt: skip
    band = (f"Band: loss ≤ {fmt(wi['level'])} + {fmt(wi['band'])}, grad norm ≤ {fmt(wi['grad_norm_level'])} + "
            f"{fmt(wi['grad_norm_band'])} ({wi['source']}).")  # fmt: skip
    return Section("What-if", [Table(_WHATIF_HEAD, rows), Para([band])])


def report_sections(doc: dict[str, Any], report_dir: str | None = None) -> list[Section]:
    """A diagnosis report's sections, in reading order: the summary and facts, the verdict's
    tables and actions, the resume plan, then each engine's details.

    Args:
        doc: the report document.
        report_dir: where the report is written, for the recovery command the plan ends on
            (default: the document's `incident.report_dir`, where it was written).
    """
    v = doc["verdict"]
    out = [Section("", [Para(inline(v["summary"])), _facts(doc)])]
    out += _verdict_sections(v)
    p = doc.get("plan") or {}
    if p.get("status") == "ready":
        where = report_dir or doc["incident"].get("report_dir")
        out.append(Section("Resume plan", plan_blocks(p, plan_dir=where)))
    return out


def detail_sections(doc: dict[str, Any]) -> list[Section]:
    """The engines' details under the verdict: findings, diff, replay, bisection, what-if."""
    out = [_findings(doc.get("findings", []))]
    if doc.get("diff"):
        out += _diff(doc["diff"])
    if doc.get("replay"):
        out.append(_replay(doc["replay"]))
    if doc.get("bisect"):
        out += _bisect(doc["bisect"])
    if doc.get("whatif"):
        out.append(_whatif(doc["whatif"]))
    if doc.get("regress"):
        out += regress_sections(doc["regress"])
    if doc.get("history"):
        out += history_sections(doc["history"])
    return out
