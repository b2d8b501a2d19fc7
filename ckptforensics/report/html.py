"""report.html: one self-contained file (no network), plots inline where matplotlib is installed.

Over 400 lines: one self-contained page, its sections and inline plots rendered from one
document.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

from ckptforensics.report.markdown import fmt, plan_lines, recovery_lines, reproduces

__all__ = ["render_html"]

CSS = """body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
.summary{background:#fff6e5;border-left:4px solid #e8a33d;padding:.6em 1em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f5f5f5}code{background:#f3f3f3;padding:0 3px}.plots img{max-width:100%;border:1px solid #eee;margin:.4em 0}"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def table(head: list[str], rows: list[list[Any]]) -> str:
    h = "".join(f"<th>{_e(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def num(x: Any) -> float:
    """Report numbers are JSON: non-finite values were stored as null."""
    return (
        float(x)
        if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
        else float("nan")
    )


def png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return (
        f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'
    )


def _short(names: list[str]) -> list[str]:
    """Names without the first component they all share ('model.', 'transformer.')."""
    first = {n.split(".", 1)[0] for n in names}
    if len(first) == 1 and all("." in n for n in names):
        return [n.split(".", 1)[1] for n in names]
    return list(names)


def _name_ticks(ax: Any, names: list[str], axis: str, most: int = 40) -> None:
    """Label an axis with names (every k-th where there are more than `most`)."""
    k = max(1, -(-len(names) // most))
    pos = list(range(0, len(names), k))
    labels = [_short(names)[i] for i in pos]
    if axis == "x":
        ax.set_xticks(pos, labels, rotation=90, fontsize=6)
    else:
        ax.set_yticks(pos, labels, fontsize=6)


def _heatmap(
    plt: Any, per: dict[str, Any], mods: list[str], v: dict[str, Any]
) -> list[tuple[str, str]]:
    """Modules (forward order, named) x replayed steps, coloured by each module's output-gradient
    and activation norm against its own median over the window (log10): the view that shows
    where a spike starts and how it travels. The first anomalous module and bad step marked."""
    import warnings

    import numpy as np

    steps = sorted(per, key=int)
    out = []
    for key, what in (("grad_norm", "output-gradient norm"), ("rms", "activation RMS")):
        m = np.array([[num(x) for x in per[s][key]] for s in steps], float).T  # [modules, steps]
        with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            rel = np.log10(m / np.nanmedian(np.where(m > 0, m, np.nan), axis=1, keepdims=True))
        keep = np.isfinite(rel).any(axis=1)
        if not keep.any():
            continue
        names = [n for n, k in zip(mods, keep, strict=True) if k]
        rel = np.clip(np.nan_to_num(rel[keep], nan=0.0, posinf=3.0, neginf=-3.0), -3, 3)
        fig, ax = plt.subplots(figsize=(10, min(12, 1.5 + 0.14 * len(names))))
        im = ax.imshow(
            rel,
            aspect="auto",
            cmap="RdBu_r",
            vmin=-max(1.0, float(np.abs(rel).max())),
            vmax=max(1.0, float(np.abs(rel).max())),
        )
        ax.set_xticks(range(len(steps)), steps, fontsize=7, rotation=90 if len(steps) > 20 else 0)
        _name_ticks(ax, names, "y", most=60)
        ax.set_xlabel("replayed step")
        fbs, fam = v.get("first_bad_step"), v.get("first_anomalous_module")
        if fbs is not None and str(fbs) in steps:
            ax.axvline(steps.index(str(fbs)), color="k", ls=":", lw=1)
        if fam and any(n == fam or n.startswith(fam + ".") for n in names):
            row = next(i for i, n in enumerate(names) if n == fam or n.startswith(fam + "."))
            ax.axhline(row, color="k", ls="--", lw=0.8)
            ax.annotate(
                f"first anomalous: {_short([fam, *names])[0]}", (0, row), fontsize=7, va="bottom"
            )
        fig.colorbar(im, ax=ax, label=f"log10 {what} / its window median")
        ax.set_title(f"per-module {what} x step, against each module's own baseline")
        out.append((f"Modules x steps: {what}", png(fig)))
    return out


def _plots(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(title, <img>) for each plot the document has data for; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    v = doc["verdict"]
    rep = doc.get("replay") or {}
    if rep.get("steps"):
        steps = [s["step"] for s in rep["steps"]]
        fig, ax = plt.subplots(1, 2, figsize=(10, 3))
        # The run's own log before the window (grey), the window logged and replayed,
        # the two checkpoints and the first bad step.
        logged = {**(rep.get("history") or {}), **(rep.get("logged") or {})}
        for a, key in ((ax[0], "loss"), (ax[1], "grad_norm")):
            ls = sorted(int(s) for s in logged if key in logged[s])
            if ls:
                a.plot(
                    ls,
                    [num(logged[str(s)][key]) for s in ls],
                    "-",
                    color="0.6",
                    lw=1,
                    label="training log",
                )
            a.plot(steps, [num(s[key]) for s in rep["steps"]], "o-", ms=3, label="replayed")
        ax[1].set_yscale("log")
        inc = doc["incident"]
        for a, t in zip(ax, ("loss", "grad norm (pre-clip)"), strict=True):
            a.set_title(t)
            a.set_xlabel("step")
            for side, style in (("before", "-"), ("after", "--")):
                st = (inc.get(side) or {}).get("step")
                if st is not None:
                    a.axvline(st, color="g", ls=style, lw=0.8, label=f"{side} checkpoint")
            if v.get("first_bad_step") is not None:
                a.axvline(v["first_bad_step"], color="r", ls=":", label="first bad step")
        ax[0].legend(fontsize=7)
        out.append(("Loss and grad norm around the spike", png(fig)))
        per, mods = rep.get("per_module_steps") or {}, rep.get("modules") or []
        s0 = v.get("first_bad_step")
        if per and mods and s0 is not None and str(s0) in per:
            others = [per[k]["grad_norm"] for k in per if k != str(s0)]
            if others:
                import warnings

                import numpy as np

                cur = np.array([num(x) for x in per[str(s0)]["grad_norm"]], float)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # modules without gradients
                    base = np.nanmedian(
                        np.array([[num(x) for x in o] for o in others], float), axis=0
                    )
                keep = np.isfinite(cur) & np.isfinite(base) & (cur > 0)
                fig, ax = plt.subplots(figsize=(10, 3.6))
                idx = np.flatnonzero(keep)
                ax.semilogy(range(len(idx)), cur[idx], label=f"step {s0}")
                ax.semilogy(range(len(idx)), base[idx], label="other steps (median)")
                _name_ticks(ax, [mods[i] for i in idx], "x")
                ax.set_title("per-module output-gradient norm (forward order of modules)")
                ax.legend()
                out.append(("Per-layer gradient norm: suspect step vs baseline", png(fig)))
        if per and mods:
            out += _heatmap(plt, per, mods, v)
        srow = next((s for s in rep["steps"] if s["step"] == s0), None)
        if srow and srow.get("sample_grad_sq"):
            sq = [num(x) for x in srow["sample_grad_sq"]]
            tot = sum(x for x in sq if math.isfinite(x)) or 1.0
            fig, ax = plt.subplots(figsize=(6, 2.6))
            ax.bar(range(len(sq)), [x / tot for x in sq])
            ax.set_title(f"share of the gradient norm² per row, step {s0}")
            ax.set_xlabel("row")
            out.append(("Per-sample gradient share", png(fig)))
    diff = doc.get("diff") or {}
    if diff.get("tensors"):
        ts = diff["tensors"]
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
        ax[0].semilogy([num(t["update_ratio"]) for t in ts], ".")
        ax[0].set_title("update/weight ratio per step, per tensor")
        ax[1].semilogy([num(t["headroom_b"]) for t in ts], ".")
        ax[1].set_title("dtype headroom (max / max|x|), per tensor")
        for a in ax:
            _name_ticks(a, [t["name"] for t in ts], "x")
        out.append(("Update/weight ratio and dtype headroom", png(fig)))
    wi = doc.get("whatif") or {}
    if wi.get("outcomes"):
        fig, ax = plt.subplots(figsize=(10, 3))
        for o in wi["outcomes"]:
            ax.plot(o["steps"], [num(x) for x in o["losses"]], "o-", label=o["mitigation"])
        if wi.get("level") is not None:
            ax.axhline(wi["level"] + wi["band"], color="k", ls=":", label="band")
        ax.set_title("what-if: loss per mitigation")
        ax.legend(fontsize=8)
        out.append(("What-if trajectories", png(fig)))
    return out


def _md_block(lines: list[str]) -> str:
    """Markdown lines (the plan, the recovery tables) in the page: tables as tables, code
    blocks as <pre>, the rest as paragraphs (no markdown library needed)."""
    out: list[str] = []
    code: list[str] | None = None
    rows: list[list[str]] = []

    def flush_rows() -> None:
        if rows:
            out.append(table(rows[0], rows[2:]) if len(rows) > 2 else "")
            rows.clear()

    for line in lines:
        if line.startswith("```"):
            if code is None:
                flush_rows()
                code = []
            else:
                out.append("<pre>" + _e("\n".join(code)) + "</pre>")
                code = None
            continue
        if code is not None:
            code.append(line)
        elif line.startswith("| "):
            rows.append([c.strip().replace("\\|", "|") for c in line.strip("|").split(" | ")])
        else:
            flush_rows()
            if line.strip():
                out.append(f"<p>{_e(line.replace('**', '').replace('`', ''))}</p>")
    flush_rows()
    return "".join(out)


def _recovery_plot(r: dict[str, Any]) -> str:
    """Loss and grad norm: the pre-incident steps, the incident leg, the resumed leg, the
    trajectory with its band, the resume and the verdict's step marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ""
    se = r["series"]
    fig, ax = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    for a, key in ((ax[0], "loss"), (ax[1], "grad_norm")):
        for leg, style, label in (
            ("pre", dict(color="0.5", lw=1), "before the resume"),
            ("incident", dict(color="r", lw=1, ls="--"), "incident leg"),
            ("resumed", dict(color="C0", lw=1.3), "resumed leg"),
        ):
            s = se.get(leg) or {}
            if s.get("step"):
                a.plot(s["step"], [num(x) for x in s[key]], label=label, **style)
        exp = se.get("expected_loss" if key == "loss" else "expected_grad_norm") or []
        steps = (se.get("resumed") or {}).get("step") or []
        if exp and len(exp) == len(steps):
            a.plot(steps, exp, color="k", ls=":", lw=1, label="pre-incident trajectory")
            if key == "loss" and len(se.get("loss_band_upper") or []) == len(steps):
                a.fill_between(
                    steps, exp, se["loss_band_upper"], color="g", alpha=0.12, label="band"
                )
        a.axvline(r["resumed_from"], color="g", lw=1, label="resumed from")
        if r.get("step") is not None:
            a.axvline(
                r["step"],
                color="r" if r["status"] == "relapsed" else "C2",
                ls="--",
                lw=1,
                label=r["status"],
            )
        a.set_ylabel(key.replace("_", " "))
    ax[1].set_yscale("log")
    ax[1].set_xlabel("step")
    ax[0].legend(fontsize=7)
    return png(fig)


def _render_recovery(doc: dict[str, Any]) -> str:
    r, v, inc = doc["recovery"], doc["verdict"], doc["incident"]
    head = r["status"] + (
        f" at step {r['step']}" if r["step"] is not None and r["status"] != "recovering" else ""
    )
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>ckptforensics recovery</title>",
        f"<style>{CSS}</style></head><body><h1>ckptforensics: recovery — {_e(head)}</h1>",
        f"<p class='summary'>{_e(v['summary'])}</p>",
        table(
            ["", ""],
            [
                ["resumed from", f"{inc['before']['path']} (step {fmt(r['resumed_from'])})"],
                ["checkpoint after the resume", r.get("checkpoint_after") or "—"],
                ["incident onset", fmt(r.get("onset"))],
            ],
        ),
    ]
    if v["recommended_actions"]:
        parts.append(
            "<h2>Next</h2><ol>"
            + "".join(f"<li>{_e(a)}</li>" for a in v["recommended_actions"])
            + "</ol>"
        )
    plot = _recovery_plot(r)
    parts.append(
        f"<h2>Loss and grad norm</h2><div class='plots'>{plot}</div>"
        if plot
        else "<p><em>Plots need the plots extra (matplotlib); tables follow.</em></p>"
    )
    parts.append("<h2>Details</h2>" + _md_block(recovery_lines(r)))
    parts.append(
        f"<p><small>{_e(inc['command'])} · ckptforensics {_e(inc['tool_version'])} · {_e(doc['schema'])}</small></p></body></html>"
    )
    return "\n".join(parts)


def render_html(doc: dict[str, Any]) -> str:
    if doc.get("recovery"):
        return _render_recovery(doc)
    if doc.get("audit"):
        from ckptforensics.report.audit import render_audit_html

        return render_audit_html(doc)
    v, inc = doc["verdict"], doc["incident"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>ckptforensics report</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>ckptforensics: {_e(v['causes'][0]['cause'].replace('_', ' '))}</h1>",
        f"<p class='summary'>{_e(v['summary'])}</p>",
        table(
            ["", ""],
            [
                [
                    "before",
                    f"{inc['before']['path']} (step {fmt(inc['before']['step'])}, {inc['before']['format']})",
                ],
                [
                    "after",
                    f"{inc['after']['path']} (step {fmt(inc['after']['step'])}, {inc['after']['format']})",
                ],
                ["causes", ", ".join(f"{c['cause']} ({c['confidence']:.0%})" for c in v["causes"])],
                ["reproduces", reproduces(v)],
                ["replay vs the run's log", (v.get("replay_check") or {}).get("reason") or "—"],
                ["first bad step", fmt(v["first_bad_step"])],
                ["first anomalous module", v["first_anomalous_module"] or "—"],
                ["layers standing out", ", ".join(v["exploding_layers"][:5]) or "—"],
                ["rollback checkpoint", v["rollback_checkpoint"] or "—"],
            ],
        ),
    ]
    if v["recommended_actions"]:
        parts.append(
            "<h2>Recommended actions</h2><ol>"
            + "".join(f"<li>{_e(a)}</li>" for a in v["recommended_actions"])
            + "</ol>"
        )
    p = doc.get("plan") or {}
    if p.get("status") == "ready":
        parts.append("<h2>Resume plan</h2>" + _md_block(plan_lines(p)))
    if v["anomalous_samples"]:
        parts.append(
            "<h2>Anomalous samples</h2>"
            + table(
                ["row", "sample id", "why"],
                [[s["index"], fmt(s["sample_id"]), s["why"]] for s in v["anomalous_samples"]],
            )
        )
    if v["corrupted_elements"]:
        parts.append(
            "<h2>Corrupted elements</h2>"
            + table(
                ["tensor", "index", "before", "after", "kind"],
                [
                    [e["tensor"], e["index"], fmt(e["before"]), fmt(e["after"]), e["kind"]]
                    for e in v["corrupted_elements"]
                ],
            )
        )
    if v["overflowing_tensors"]:
        parts.append(
            "<h2>Overflowing tensors</h2>"
            + table(
                ["name", "dtype", "where"],
                [[o["name"], o["dtype"], o["where"]] for o in v["overflowing_tensors"]],
            )
        )
    plots = _plots(doc)
    if plots:
        parts.append(
            "<h2>Plots</h2><div class='plots'>"
            + "".join(f"<h3>{_e(t)}</h3>{img}" for t, img in plots)
            + "</div>"
        )
    else:
        parts.append("<p><em>Plots need the plots extra (matplotlib); tables follow.</em></p>")
    parts.append(
        "<h2>Findings</h2>"
        + table(
            ["id", "severity", "kind", "subject", "message"],
            [
                [f["id"], f["severity"], f["kind"], f["subject"], f["message"]]
                for f in doc["findings"]
            ],
        )
    )
    wi = doc.get("whatif") or {}
    if wi.get("outcomes"):
        parts.append(
            "<h2>What-if</h2>"
            + table(
                ["mitigation", "on track", "max loss", "max grad norm"],
                [
                    [
                        o["mitigation"],
                        fmt(o["on_track"]),
                        fmt(o["max_loss"]),
                        fmt(o["max_grad_norm"]),
                    ]
                    for o in wi["outcomes"]
                ],
            )
        )
    parts.append(
        f"<p><small>{_e(inc['command'])} · ckptforensics {_e(inc['tool_version'])} · {_e(doc['schema'])}</small></p></body></html>"
    )
    return "\n".join(parts)
